"""The models geotrain trains; none of them knows anything of distribution.

- :mod:`.gpt`: a GPT decoder (after nanoGPT), byte vocabulary;
- :mod:`.hf`: Hugging Face causal LMs built from a config (the ``hf`` extra);
- :mod:`.factory`: ``build_model`` from the model section, ``count_params``;
- :mod:`.pretrained`: local pretrained weights in, a Hugging Face model out;
- :mod:`.gpt2`: geotrain's GPT as a Hugging Face GPT-2, and the byte vocabulary as a tokenizer.
"""

from geotrain.models.factory import build_model, count_params
from geotrain.models.gpt import GPT, VOCAB_SIZE
from geotrain.models.pretrained import check_pretrained, export_model

__all__ = ["GPT", "VOCAB_SIZE", "build_model", "check_pretrained", "count_params", "export_model"]
