"""What ``import ort_trainer`` does before anything else: find the subpackages in a source checkout
(``source_tree``) and apply ``ORT_TRAINER_LOG_LEVEL`` (``logging_env``); ``runtimes`` says which ONNX Runtime
package is installed (stock or onnxruntime-training), for ``python -m ort_trainer`` and the engine choice;
``versions`` holds the newest releases CI has run and names installed ones that are newer."""

from .logging_env import ENV_VAR, LOGGER_NAME, configure_from_env
from .source_tree import SUBPACKAGES, install

__all__ = ["ENV_VAR", "LOGGER_NAME", "SUBPACKAGES", "configure_from_env", "install"]
