"""Training data that needs no download: corpus, per-rank shards, batch sampling.

- :mod:`.corpus`: the default CPython corpus or the user's text, bytes as tokens, held-out split;
- :mod:`.shards`: which tokens each rank reads (IID, non-IID, site-private), launch-time checks;
- :mod:`.sampler`: reproducible random windows, fixed evaluation batches, a rank's data;
- :mod:`.prepare`: ``geotrain data prepare``, text/JSONL/Parquet to token shards with a manifest;
- :mod:`.tokens`: those shards read window by window (never whole), shared out per rank, sampled like the bytes.
"""

from geotrain.data.corpus import load_corpus, split_corpus
from geotrain.data.sampler import BatchSampler, RankData, build_rank_data, eval_batches
from geotrain.data.shards import check_data, shard_for_rank, site_shard
from geotrain.data.tokens import tokenizer_file, vocab_size

__all__ = [
    "BatchSampler",
    "RankData",
    "build_rank_data",
    "check_data",
    "eval_batches",
    "load_corpus",
    "shard_for_rank",
    "site_shard",
    "split_corpus",
    "tokenizer_file",
    "vocab_size",
]
