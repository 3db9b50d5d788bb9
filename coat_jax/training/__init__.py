"""Config-driven training: ``python train.py`` is a thin front end to :func:`train`."""

from coat_jax.training.checkpoint import Checkpointer, CheckpointError
from coat_jax.training.config import MeshConfig, TrainConfig, from_dict, load_config
from coat_jax.training.loop import TrainResult, train
from coat_jax.training.step import make_train_step

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "MeshConfig",
    "TrainConfig",
    "TrainResult",
    "from_dict",
    "load_config",
    "make_train_step",
    "train",
]
