"""Keras 3 DP-SGD: models, optimizers and callbacks built on tf_pxg."""

from tf_pxg.dp.noisy_loss import NoisyLoss
from tf_pxg.dp.sparse_selection import DPAdaFEST
from tf_pxg.dp.sparse_selection import DPFEST
from tf_pxg.keras import callbacks
from tf_pxg.keras.callbacks import PrivacyCallback
from tf_pxg.keras.losses import per_example_losses
from tf_pxg.keras.models import DPModel
from tf_pxg.keras.models import DPSequential
from tf_pxg.keras.models import make_dp_model_class
from tf_pxg.keras.models import make_private
from tf_pxg.keras.optimizers import DPAdam
from tf_pxg.keras.optimizers import DPOptimizer
from tf_pxg.keras.optimizers import DPSGD

__all__ = [
    "DPAdaFEST",
    "DPAdam",
    "DPFEST",
    "DPModel",
    "DPOptimizer",
    "DPSGD",
    "DPSequential",
    "NoisyLoss",
    "PrivacyCallback",
    "callbacks",
    "make_dp_model_class",
    "make_private",
    "per_example_losses",
]
