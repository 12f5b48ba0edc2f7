"""The installed layout: one top-level package, graph_rewriter, with the passes as its
subpackage graph_rewriter.passes (the repository keeps them in passes/, mapped in
setup.cfg). A user's own ``passes`` module beside their script must not shadow them."""

import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def test_a_users_passes_module_beside_the_script_does_not_break_rewrite(tmp_path):
    (tmp_path / "passes.py").write_text("raise ImportError('the user\\'s own passes.py was imported')\n")
    (tmp_path / "train.py").write_text(
        "import tensorflow as tf\n"
        "import graph_rewriter as gr\n"
        "tf.compat.v1.disable_eager_execution()\n"
        "g = tf.Graph()\n"
        "with g.as_default():\n"
        "    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name='x')\n"
        "    w = tf.compat.v1.get_variable('w', [2, 1], use_resource=True)\n"
        "    loss = tf.reduce_mean(tf.matmul(x, w), name='loss')\n"
        "    tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name='train_op')\n"
        "r = gr.rewrite(g.as_graph_def(), devices_per_worker=2, device_type='CPU')\n"
        "import graph_rewriter.passes\n"
        "print(r.num_replicas, graph_rewriter.passes.__name__)\n")
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2", "graph_rewriter.passes"]


def test_the_wheel_installs_one_top_level_package(tmp_path):
    """Built without build isolation (the test machine may be offline): the setuptools
    of the environment (the test extra installs it) reads setup.cfg as pip would."""
    src = tmp_path / "src"   # a copy: pip builds in the source tree (build/, egg-info)
    src.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    for name in ("graph_rewriter", "passes"):
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = [p for p in os.listdir(out) if p.endswith(".whl")]
    names = zipfile.ZipFile(out / wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"graph_rewriter"}, top
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(out / wheel).read(top_level).decode().split() == ["graph_rewriter"]
    passes = sorted(n for n in names if n.startswith("graph_rewriter/passes/"))
    assert "graph_rewriter/passes/__init__.py" in passes and "graph_rewriter/passes/allreduce.py" in passes
    for table in ("gpu_kernels.json", "cpu_kernels.json", "op_defs.pb", "tf_protos.pb"):
        assert f"graph_rewriter/data/{table}" in names   # rewriting without TensorFlow needs them


def test_no_module_defines_a_top_level_name_twice():
    """A module-level constant assigned twice is the second value everywhere, the first
    one's readers included: analysis.py's _LINEAR (the ops a statistic passes linearly)
    was silently replaced so by a list of layout ops, and every product of a statistic
    counted as non-linear. Functions and classes alike."""
    import ast
    import collections
    twice = []
    for folder in ("graph_rewriter", "passes", "tools"):
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                counts = collections.Counter()
                for node in tree.body:
                    if isinstance(node, ast.Assign):
                        counts.update(t.id for t in node.targets if isinstance(t, ast.Name))
                    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                        counts[node.name] += 1
                twice += [f"{os.path.relpath(path, REPO)}: {k}" for k, v in counts.items() if v > 1]
    assert not twice, twice
