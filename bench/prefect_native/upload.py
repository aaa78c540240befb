"""Bundle upload step for the Prefect-native comparison: copy the bundle into a local directory.

Prefect ships S3/GCS/Azure steps only; a local copy is the cheapest possible step, so the
comparison favours Prefect's path.
"""

import argparse
import shutil
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--directory", required=True)
parser.add_argument("--key", required=True)
parser.add_argument("path")
args = parser.parse_args()
target = Path(args.directory) / args.key
target.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(args.path, target)
