"""Writes the TensorFlow facts that let graph_rewriter rewrite without importing TensorFlow:

- graph_rewriter/data/tf_protos.pb: a FileDescriptorSet of TensorFlow's GraphDef,
  MetaGraphDef, SavedModel, SaverDef, VariableDef and OpDef protos (and what they import),
  taken from the installed TensorFlow's generated modules;
- graph_rewriter/data/op_defs.pb: the OpList of every op this TensorFlow registers
  (argument names and positions, types, attributes and defaults, statefulness);
- graph_rewriter/data/cpu_kernels.json: the CPU and DEVICE_DEFAULT kernels it registers,
  with their dtype constraints (the GPU ones come from tools/gen_kernel_table.py, which
  needs a CUDA build).

Why: importing TensorFlow takes about 4 s, while a rewrite of ResNet50 takes under one;
rewriting needs TensorFlow's protos and its op registry, not its runtime. The tables are
generated, never edited by hand, and tests/test_tf_tables.py compares them with the
installed TensorFlow. Run it once per supported TensorFlow release:

    pip install 'tensorflow-cpu==2.21.*' && python tools/gen_tf_tables.py
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DATA = os.path.join(os.path.dirname(__file__), "..", "graph_rewriter", "data")


def write_kernel_table(path, version, table):
    """Writes {op: [kernel constraints]} as gpu_kernels.json and cpu_kernels.json are
    written: one op per line, sorted, so that a new TensorFlow gives a readable diff."""
    lines = [f'  "{op}": {json.dumps(sorted(table[op], key=json.dumps), sort_keys=True)}'
             for op in sorted(table)]
    text = '{\n  "tensorflow": "%s",\n  "kernels": {\n  %s\n  }\n}\n' % (version, ",\n  ".join(lines))
    json.loads(text)  # the hand-assembled text must still be JSON
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=DATA, help="where to write the three files")
    args = parser.parse_args(argv)
    import tensorflow  # noqa: F401  (first: graph_rewriter.protos then takes TensorFlow's own)
    from graph_rewriter import opdefs, protos
    version = opdefs.live_tensorflow_version()
    descriptors = protos.live_descriptor_set().SerializeToString(deterministic=True)
    ops = opdefs.live_op_list().SerializeToString(deterministic=True)
    kernels = opdefs.registered_kernels(("CPU", "DEFAULT"))
    os.makedirs(args.out_dir, exist_ok=True)
    for name, data in (("tf_protos.pb", descriptors), ("op_defs.pb", ops)):
        with open(os.path.join(args.out_dir, name), "wb") as f:
            f.write(data)
    write_kernel_table(os.path.join(args.out_dir, "cpu_kernels.json"), version, kernels)
    print(f"wrote {len(opdefs.live_op_list().op)} op definitions, "
          f"{sum(map(len, kernels.values()))} CPU kernels and "
          f"{len(protos.live_descriptor_set().file)} proto files (TensorFlow {version}) "
          f"to {os.path.normpath(args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
