"""Packaging for tf_pxg: per-example gradients and DP-SGD for TensorFlow 2 / Keras 3."""

import setuptools

setuptools.setup(
    name="tf_pxg",
    version="0.1.0",
    description=(
        "Per-example gradients (a drop-in tf.GradientTape) and "
        "differentially private training for Keras 3."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",  # the full text is LICENSE (as TensorFlow's)
    packages=setuptools.find_packages(include=["tf_pxg", "tf_pxg.*"]),
    # The native ops' C++ sources, compiled on first use (tf_pxg.native).
    package_data={"tf_pxg": ["kernels/*.cc", "kernels/*.h"]},
    python_requires=">=3.10",
    install_requires=[
        # The tested range (README "Supported versions", tf_pxg/_versions.py):
        # the lowest pair runs a subset in .ci/run, the newest the full suite.
        "tensorflow>=2.16,<2.22",
        "keras>=3.7,<3.16",
        # No tensorflow-probability: its [tf] extra pulls tf-keras, whose
        # releases each pin one TensorFlow minor, so pip would upgrade the
        # TensorFlow a user installed first (tf_pxg.dp.noise splits seeds
        # as TFP did, without it).
        "absl-py>=1.0",
        "dp-accounting>=0.6.0",
        "scipy>=1.7",  # root finding in tf_pxg.accounting
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-xdist>=3"],
        "examples": ["scikit-learn>=1.0"],
        # tf_pxg.data.beam: Poisson sampling of data beyond memory. The
        # [tfrecord] extra brings the CRC32C that TFRecord files need.
        "beam": ["apache-beam[tfrecord]>=2.50"],
        # KerasHub models (tests/test_keras_hub.py,
        # examples/dp_finetune_text.py). keras-hub 0.32 needs keras>=3.15
        # and tensorflow-text, whose releases each pin one TF minor
        # (2.21.x: tensorflow>=2.21,<2.22).
        "hub": ["keras-hub>=0.32"],
        # tf_pxg.probability (docs/probability.md). TFP imports tf-keras,
        # whose releases each pin one TF minor: on the newest TF (>= 2.18,
        # TFP 0.25) this resolves to the matching tf-keras without touching
        # TensorFlow or Keras; TF 2.16-2.17 need TFP 0.24 and the tf-keras
        # of their minor, pinned by hand (the command is in the docs).
        "probability": ["tensorflow-probability>=0.24", "tf-keras>=2.16"],
        # tf_pxg.tuning's keras-tuner tuner (DP hyperparameter search with
        # only the winner released; tests/test_tuning_keras_tuner.py).
        # keras-tuner 1.4.7+ supports Keras 3; it pins no TF or Keras.
        "tuner": ["keras-tuner>=1.4.7"],
    },
    entry_points={"console_scripts": ["tf-pxg=tf_pxg.cli:run"]},
)
