"""Bundle execution step for the Prefect-native comparison: run the bundle from the local directory."""

import argparse
from pathlib import Path

from prefect.bundles.execute import execute_bundle_from_file

parser = argparse.ArgumentParser()
parser.add_argument("--directory", required=True)
parser.add_argument("--key", required=True)
args = parser.parse_args()
execute_bundle_from_file(str(Path(args.directory) / args.key))
