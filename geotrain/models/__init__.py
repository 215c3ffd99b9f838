"""The models geotrain trains; none of them knows anything of distribution.

- :mod:`.gpt`: a GPT decoder (after nanoGPT), byte vocabulary;
- :mod:`.hf`: Hugging Face causal LMs built from a config (the ``hf`` extra);
- :mod:`.factory`: ``build_model`` from the model section, ``count_params``.
"""

from geotrain.models.factory import build_model, count_params
from geotrain.models.gpt import GPT, VOCAB_SIZE

__all__ = ["GPT", "VOCAB_SIZE", "build_model", "count_params"]
