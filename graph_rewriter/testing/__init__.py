"""graph_rewriter.testing: the example models and the equivalence harness.

- ``models``: the model zoo, small seeded single-device tf.compat.v1 training graphs
  (``build(model, optimizer)``, ``MODELS``, ``OPTIMIZERS_V1``, ``OPTIMIZERS_KERAS``,
  ``Example``);
- ``harness``: trains an example on one device and a rewritten copy through
  ``graph_rewriter.Session`` with the same batches (``run_single``, ``run_rewritten``,
  ``read_replica_copies``, ...), so that the two can be compared;
- ``real_models``: real-model training graphs in the style of well-known training
  scripts (BERT-style encoder, loss scaling, ResNet-style, LSTM language model, Wide & Deep).

The test suite, the tools (benchmarks, tools/compare_outputs.py) and users who want to
check their own rewrite use them; the rewriter itself never imports this package. It
needs TensorFlow and numpy (``pip install 'graph-rewriter[testing]'``), and tf_keras for
the Keras models, installed separately: ``pip install --no-deps 'tf-keras==2.21.*'``
(the version matching TensorFlow's; --no-deps because tf-keras depends on the
``tensorflow`` distribution, which would pull the full wheel next to tensorflow-cpu).
"""
