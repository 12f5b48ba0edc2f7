"""Writes graph_rewriter/data/gpu_kernels.json: the kernels a CUDA build of TensorFlow can
run on a GPU (those registered for GPU and for DEVICE_DEFAULT), with dtype constraints.

Why: placement asks "does this op have a GPU kernel for these dtypes?". The
``tensorflow-cpu`` wheel registers no GPU kernels at all, yet rewriting for GPU machines
must work on CPU-only machines (CI, laptops, build servers). So the answer comes from the
live registry when it knows GPU kernels, and from this table otherwise.

Run it with a GPU build of TensorFlow installed (the ``tensorflow`` wheel for Linux; no
GPU needed), once per supported TensorFlow release. DEVICE_DEFAULT kernels are included
because TensorFlow registers many int32 GPU kernels that way (host-memory Sum, Shape, ...)
and the CPU wheel registers a different set of them:

    pip install 'tensorflow==2.21.*' && python tools/gen_kernel_table.py
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "graph_rewriter", "data", "gpu_kernels.json")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the table")
    args = parser.parse_args(argv)
    from gen_tf_tables import write_kernel_table   # this folder is on sys.path when run as a script
    from graph_rewriter.opdefs import registered_gpu_kernels
    version, table = registered_gpu_kernels()
    if "MatMul" not in table:
        print("gen_kernel_table: this TensorFlow registers no GPU kernels (tensorflow-cpu?); "
              "install the 'tensorflow' wheel, which is built with CUDA", file=sys.stderr)
        return 2
    write_kernel_table(args.out, version, table)
    print(f"wrote {len(table)} ops, {sum(map(len, table.values()))} GPU kernels "
          f"(TensorFlow {version}) to {os.path.normpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
