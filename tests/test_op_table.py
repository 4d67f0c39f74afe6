"""The one op table (issue 49, item 3): every op type that a traced Keras
DP step records on its data path has a row; an op type without one is
refused by name; the coverage figure in docs/coverage.md is the table's."""

import pathlib
import re

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_pxg
from tf_pxg.interface.classify import Classifier, DATA
from tf_pxg.per_example import op_table

_DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "coverage.md"


def _models():
  return {
      "mlp": (keras.Sequential([keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dropout(0.1),
                                keras.layers.Dense(3)]),
              np.random.randn(4, 5).astype("float32")),
      "cnn": (keras.Sequential([
          keras.layers.Conv2D(4, 3, activation="relu"),
          keras.layers.GroupNormalization(2),
          keras.layers.MaxPooling2D(), keras.layers.Flatten(),
          keras.layers.Dense(3)]),
              np.random.randn(4, 8, 8, 1).astype("float32")),
      "text": (keras.Sequential([
          keras.layers.Embedding(20, 4, mask_zero=True),
          keras.layers.LSTM(4), keras.layers.Dense(3)]),
               np.random.randint(0, 20, size=(4, 6)).astype("int32")),
      "sequence": (keras.Sequential([
          keras.layers.Dense(8, activation="gelu"),
          keras.layers.LayerNormalization(),
          keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)]),
                   np.random.randn(4, 6, 5).astype("float32")),
  }


@pytest.mark.parametrize("name", ["mlp", "cnn", "text", "sequence"])
def test_every_op_on_a_keras_data_path_has_a_row(name):
  model, x = _models()[name]
  model(x)
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=None)
  y = np.zeros(len(x), "int32")
  seen = {}

  @tf.function
  def step(x, y):
    with tf_pxg.GradientTape() as tape:
      losses = loss(y, model(x, training=True))
    classifier = Classifier(tape._recorder, [], len(x))  # pylint: disable=protected-access
    for e in tape._recorder.entries:  # pylint: disable=protected-access
      if any(classifier.status.get(t) == DATA for t in e.input_ids):
        seen[e.op_type] = op_table.classify(e.op_type)
    return losses

  step(tf.constant(x), tf.constant(y))
  assert seen
  unknown = sorted(t for t, c in seen.items() if c == op_table.UNKNOWN)
  assert not unknown, unknown


def test_an_op_without_a_row_is_refused_by_name():
  assert op_table.classify("Lu") == op_table.UNKNOWN
  w = tf.Variable(tf.ones([3, 3]))
  x = tf.constant(np.random.randn(4, 3, 3).astype("float32"))
  with tf_pxg.GradientTape() as tape:
    lu, _ = tf.linalg.lu(0.1 * x * w + 3.0 * tf.eye(3))
    losses = tf.reduce_sum(lu, [1, 2])
  with pytest.raises(ValueError, match="op 'Lu'.*allowlist"):
    tape.per_example_gradient(losses, [w])


def test_classes_cover_the_engine_knowledge():
  assert op_table.classify("MatMul") == op_table.RULE
  assert op_table.classify("Relu") == op_table.ROW_WISE
  assert op_table.classify("Unique") == op_table.MIXING
  assert op_table.classify("FusedBatchNormV3") == op_table.MIXING
  assert op_table.classify("Shape") == op_table.SHAPE_READ
  assert op_table.classify("ReadVariableOp") == op_table.RESOURCE_READ
  assert op_table.classify("LookupTableInsertV2") == op_table.WRITE
  assert op_table.classify("AssignAddVariableOp") == op_table.WRITE
  assert op_table.classify("StatelessIf") == op_table.CALL
  cov = op_table.coverage()
  assert cov["registered"] == len(op_table.op_types()) > 1000
  assert sum(cov[c] for c in op_table.CLASSES) == cov["registered"]


def test_docs_state_the_tables_coverage():
  text = _DOCS.read_text()
  match = re.search(r"On TensorFlow (\S+), (\d+) of (\d+) registered op types "
                    r"are classified", text)
  assert match, "docs/coverage.md lacks the op table's coverage sentence"
  if match.group(1) != tf.__version__:
    pytest.skip(f"docs measured on TF {match.group(1)}, here {tf.__version__}")
  cov = op_table.coverage()
  assert int(match.group(3)) == cov["registered"]
  assert int(match.group(2)) == cov["registered"] - cov[op_table.UNKNOWN]
