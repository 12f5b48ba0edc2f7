"""Shared test setup: quiet TensorFlow and graph mode. (pytest puts this folder on sys.path
itself, which lets test modules import each other's helpers.)"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()
