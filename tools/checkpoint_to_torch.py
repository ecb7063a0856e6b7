#!/usr/bin/env python3
"""A meshtrain checkpoint as one PyTorch file, or a listing of it.

    python3 tools/checkpoint_to_torch.py SAVE_DIR|STEP_DIR OUT.pt
    python3 tools/checkpoint_to_torch.py SAVE_DIR|STEP_DIR --list

Each rank's shard (rank-NNNNN.bin) is a torch.save archive: a dict of 1-D
tensors "c0", "c1", ... (and "rng", that rank's generator state). The
step directory's manifest.json says what each key is: the parameter's name in
the single-process model, the kind ("value" or an optimizer state such as
"exp_avg"), the full shape, the tensor-parallel slab (tp_dim, tp_index,
tp_size: the full tensor cut by torch.chunk along tp_dim) and the flat offset
within that slab. This script checks each shard's SHA-256 against the
manifest, assembles the full tensors, and saves

    {"model": {name: tensor}, "optimizer": {name: {kind: tensor}},
     "optimizer_steps": {name: int}, "step": N, "config": {...}}

with torch.save, which any layout's checkpoint gives alike. It needs only
PyTorch (python3-torch); meshtrain does not need Python.
"""
import hashlib
import json
import os
import re
import sys

import torch


class Refused(Exception):
    """A bad input, said in one line naming the file (no traceback)."""


STEP_NAME = re.compile(r"step-[0-9]{8}")


def step_directory(path):
    """The step directory itself, or the one a save directory's `latest` names
    (only a step-NNNNNNNN directory inside it, as meshtrain checks)."""
    if os.path.exists(os.path.join(path, "manifest.json")):
        return path
    latest = os.path.join(path, "latest")
    if not os.path.isfile(latest):
        raise Refused(f"{path}: neither a step directory (no manifest.json) nor a save directory (no 'latest')")
    name = open(latest).read().strip()
    if not STEP_NAME.fullmatch(name):
        raise Refused(f"{latest} holds '{name}', not a step directory name (step-NNNNNNNN) inside {path}")
    step_dir = os.path.join(path, name)
    if not os.path.isfile(os.path.join(step_dir, "manifest.json")):
        raise Refused(f"{latest} names {step_dir}, which has no manifest.json (missing, or never committed)")
    return step_dir


def read_manifest(step_dir):
    path = os.path.join(step_dir, "manifest.json")
    try:
        manifest = json.load(open(path))
        for key in ("step", "world_size", "config", "shards"):
            manifest[key]
        return manifest
    except ValueError as e:
        raise Refused(f"{path}: not valid JSON ({e}): truncated or edited")
    except (KeyError, TypeError) as e:
        raise Refused(f"{path}: no {e} field: not a meshtrain manifest, or edited")


def load_shard(step_dir, shard):
    if not re.fullmatch(r"rank-[0-9]{5}\.bin", str(shard.get("file"))):
        raise Refused(f"{step_dir}/manifest.json: shard file '{shard.get('file')}' is not rank-NNNNN.bin")
    path = os.path.join(step_dir, shard["file"])
    if not os.path.isfile(path):
        raise Refused(f"{path}: missing (the manifest names it)")
    data = open(path, "rb").read()
    if len(data) != shard["bytes"] or hashlib.sha256(data).hexdigest() != shard["sha256"]:
        raise Refused(f"{path}: size or SHA-256 differs from the manifest (corrupt or truncated)")
    return torch.load(path)


def assemble(step_dir, manifest):
    """{(param, kind): full tensor}: every chunk copied into its slab at its offset."""
    full = {}
    for shard in manifest["shards"]:
        tensors = load_shard(step_dir, shard)
        for c in shard["content"]["chunks"]:
            data = tensors[c["key"]]
            key = (c["param"], c["kind"])
            if key not in full:
                full[key] = torch.zeros(c["shape"], dtype=data.dtype)
            whole = full[key]
            slab = whole if c["tp_dim"] < 0 else torch.chunk(whole, c["tp_size"], c["tp_dim"])[c["tp_index"]]
            flat = slab.contiguous().view(-1)
            flat[c["offset"]:c["offset"] + data.numel()] = data
            slab.copy_(flat.view_as(slab))
    return full


def argv_path():
    return sys.argv[1] if len(sys.argv) > 1 else "?"


def main(argv):
    if len(argv) != 3 or (argv[2] != "--list" and argv[2].startswith("-")):
        sys.exit(__doc__)
    step_dir = step_directory(argv[1])
    manifest = read_manifest(step_dir)
    full = assemble(step_dir, manifest)
    out = {"model": {}, "optimizer": {}, "optimizer_steps": {}, "step": manifest["step"], "config": manifest["config"]}
    for (param, kind), tensor in sorted(full.items()):
        if kind == "value":
            out["model"][param] = tensor
        else:
            out["optimizer"].setdefault(param, {})[kind] = tensor
    for shard in manifest["shards"]:
        out["optimizer_steps"].update(shard["content"]["steps"])
    if argv[2] == "--list":
        print(f"{step_dir}: step {manifest['step']}, saved by {manifest['world_size']} ranks")
        for (param, kind), tensor in sorted(full.items()):
            print(f"  {param:40s} {kind:12s} {tuple(tensor.shape)} {tensor.dtype}")
        return
    try:
        torch.save(out, argv[2])
    except (OSError, RuntimeError) as e:  # torch.save raises RuntimeError for a missing directory
        raise Refused(f"{argv[2]}: cannot write it ({getattr(e, 'strerror', None) or e})")
    print(f"{step_dir} -> {argv[2]}: {len(out['model'])} parameters, step {manifest['step']}")


if __name__ == "__main__":
    try:
        main(sys.argv)
    except Refused as e:
        sys.exit(f"checkpoint_to_torch: {e}")
    except (OSError, KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        sys.exit(f"checkpoint_to_torch: {argv_path()}: not a checkpoint this script can read ({type(e).__name__}: {e})")
