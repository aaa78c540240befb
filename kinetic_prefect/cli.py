"""``kinetic-prefect``: small helper commands (the work itself goes through Prefect's own CLI)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from kinetic_prefect import accelerators

CATALOG_START, CATALOG_END = "<!-- catalog:start -->", "<!-- catalog:end -->"


def readme_with_catalog(text: str) -> str:
    """The README text with the generated catalog table between its markers."""
    pattern = re.compile(re.escape(CATALOG_START) + r".*?" + re.escape(CATALOG_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"the README has no {CATALOG_START} ... {CATALOG_END} section")
    block = f"{CATALOG_START}\n{accelerators.markdown_table().rstrip()}\n{CATALOG_END}"
    return pattern.sub(lambda _: block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kinetic-prefect")
    sub = parser.add_subparsers(dest="command", required=True)
    catalog = sub.add_parser("catalog", help="print the accelerator catalog as a Markdown table")
    catalog.add_argument("--write-readme", metavar="README", help="rewrite the catalog section of this file")
    worker = sub.add_parser("gke-worker-manifests", help="print manifests that run a kinetic-gke worker in a cluster")
    worker.add_argument("--pool", required=True)
    worker.add_argument("--image", required=True, help="an image with kinetic-prefect[gcp,k8s] installed")
    worker.add_argument("--namespace", default="default")
    args = parser.parse_args(argv)
    if args.command == "gke-worker-manifests":
        import yaml

        from kinetic_prefect.workers.gke_deploy import worker_manifests

        sys.stdout.write(yaml.safe_dump_all(worker_manifests(args.pool, namespace=args.namespace, image=args.image),
                                            sort_keys=False))
        return 0
    if args.command == "catalog":
        if args.write_readme:
            path = Path(args.write_readme)
            path.write_text(readme_with_catalog(path.read_text()))
        else:
            sys.stdout.write(accelerators.markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
