"""What the user says: trainer options, their sections and checks, and the model description.

- ``options``: ``ORTTrainerOptions`` (the legacy nested dict, checked and typed);
- ``_sections`` / ``_checks``: one dataclass per options section, and the small checker they share;
- ``model_desc``: the model description (input/output names, shapes, dtypes) and its validation.

Nothing here imports the rest of the trainer: every other room may read it.
"""

from .model_desc import ModelDescription
from .options import ORTTrainerOptions

__all__ = ["ModelDescription", "ORTTrainerOptions"]
