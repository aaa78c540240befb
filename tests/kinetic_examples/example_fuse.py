"""Kinetic's FUSE example (examples/example_fuse.py, docs/examples/example_fuse.md), ported by its import line:
``Data(..., fuse=True)`` as volumes and as arguments, a nested tree, a single file, several FUSE volumes, FUSE
beside downloaded data, and a FUSE volume with a Data argument and a plain one. Seven jobs, each checked as
Kinetic's script checks them. On kinetic-local the local FUSE data is read in place (tests/pod/test_fuse_data.py runs
this script against a pool whose store is fake-gcs-server); on kinetic-gke it is uploaded once and mounted."""

import json
import os
import shutil
import tempfile

from kinetic_prefect import kinetic  # was: import kinetic
from kinetic_prefect.kinetic import Data  # was: from kinetic import Data


@kinetic.run(accelerator="cpu")
def read_fuse_arg(data_path):
    """FUSE data passed as an argument."""
    with open(f"{data_path}/train.csv") as f:
        return {"files": sorted(os.listdir(data_path)), "content": f.read()}


@kinetic.run(accelerator="cpu")
def read_fuse_file(config_path):
    """One FUSE file: the function gets the file's path."""
    with open(config_path) as f:
        return json.load(f)


def make_read_fuse_volume(dataset_dir):
    @kinetic.run(accelerator="cpu", volumes={"/data": Data(dataset_dir, fuse=True)})
    def read_fuse_volume():
        with open("/data/train.csv") as f:
            return {"files": sorted(os.listdir("/data")), "content": f.read()}

    return read_fuse_volume


def make_read_nested(nested_dataset):
    @kinetic.run(accelerator="cpu", volumes={"/data": Data(nested_dataset, fuse=True)})
    def read_nested():
        with open("/data/subdir/nested.txt") as f:
            return {"root_files": sorted(os.listdir("/data")), "nested": f.read()}

    return read_nested


def make_check_multiple_volumes(data_dir, weights_dir):
    @kinetic.run(
        accelerator="cpu",
        volumes={"/data": Data(data_dir, fuse=True), "/weights": Data(weights_dir, fuse=True)},
    )
    def check_multiple_volumes():
        return {"data_files": sorted(os.listdir("/data")), "weight_files": sorted(os.listdir("/weights"))}

    return check_multiple_volumes


def make_mixed_volumes(fuse_dir, dl_dir):
    @kinetic.run(accelerator="cpu", volumes={"/fuse_data": Data(fuse_dir, fuse=True), "/dl_data": Data(dl_dir)})
    def mixed_volumes():
        with open("/fuse_data/fuse.txt") as f, open("/dl_data/dl.txt") as g:
            return {"fuse": f.read(), "dl": g.read()}

    return mixed_volumes


def make_train(wt_dir):
    @kinetic.run(accelerator="cpu", volumes={"/weights": Data(wt_dir, fuse=True)})
    def train(config_path, lr=0.001):
        with open(config_path) as f:
            cfg = json.load(f)
        return {
            "config": cfg,
            "lr": lr,
            "has_weights": os.path.isdir("/weights"),
            "weight_files": sorted(os.listdir("/weights")),
        }

    return train


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def main():
    root = tempfile.mkdtemp(prefix="kn-fuse-example-")
    try:
        dataset = os.path.dirname(write(f"{root}/1_dataset/train.csv", "feature,label\n1,100\n2,200\n3,300\n"))
        result = make_read_fuse_volume(dataset)()
        print(f"Test 1 (fuse volume): {result}")
        assert result["files"] == ["train.csv"] and "1,100" in result["content"]

        write(f"{root}/2_nested/root.txt", "root data")
        write(f"{root}/2_nested/subdir/nested.txt", "nested data")
        result = make_read_nested(f"{root}/2_nested")()
        print(f"Test 2 (nested dirs): {result}")
        assert "subdir" in result["root_files"] and "root.txt" in result["root_files"] and "nested" in result["nested"]

        write(f"{root}/3_data/data.csv", "data,100")
        write(f"{root}/3_weights/model.bin", "pretrained-weights")
        result = make_check_multiple_volumes(f"{root}/3_data", f"{root}/3_weights")()
        print(f"Test 3 (multiple fuse volumes): {result}")
        assert result == {"data_files": ["data.csv"], "weight_files": ["model.bin"]}

        write(f"{root}/4_arg/train.csv", "feature,label\n1,100\n2,200\n3,300\n")
        result = read_fuse_arg(Data(f"{root}/4_arg", fuse=True))
        print(f"Test 4 (fuse data arg): {result}")
        assert result["files"] == ["train.csv"] and "1,100" in result["content"]

        config = write(f"{root}/5_config/config.json", json.dumps({"lr": 0.01, "epochs": 10}))
        result = read_fuse_file(Data(config, fuse=True))
        print(f"Test 5 (fuse single file): {result}")
        assert result["lr"] == 0.01

        write(f"{root}/6_fuse/fuse.txt", "fuse content")
        write(f"{root}/6_dl/dl.txt", "downloaded content")
        result = make_mixed_volumes(f"{root}/6_fuse", f"{root}/6_dl")()
        print(f"Test 6 (fuse + downloaded volumes): {result}")
        assert "fuse" in result["fuse"] and "downloaded" in result["dl"]

        write(f"{root}/7_weights/model.bin", "pretrained-weights")
        cfg = write(f"{root}/7_config/config.json", json.dumps({"lr": 0.01, "epochs": 10}))
        result = make_train(f"{root}/7_weights")(Data(cfg), lr=0.05)
        print(f"Test 7 (fuse volume + data arg + plain arg): {result}")
        assert result["config"]["lr"] == 0.01 and result["lr"] == 0.05
        assert result["has_weights"] is True and result["weight_files"] == ["model.bin"]
        print("\nAll FUSE examples passed!")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
