"""Shared test setup: quiet TensorFlow, graph mode, and the repository on sys.path."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()
