"""``geotrain data ...``: turn text into token shards that training reads window by window."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from geotrain.cli.common import console, fail

data_app = typer.Typer(help="Token shards for training.", no_args_is_help=True, add_completion=False)


@data_app.command("prepare")
def prepare_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="Text files, directories, .jsonl or .parquet files.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="New (or empty) directory for the shards and manifest.")],
    tokenizer: Annotated[
        str, typer.Option("--tokenizer", help="bpe (trained on the inputs), bytes, a tokenizer.json or a local tokenizer dir.")
    ] = "bpe",
    vocab_size: Annotated[int, typer.Option("--vocab-size", min=257, max=1 << 20, help="Vocabulary of a trained bpe.")] = 8192,
    text_field: Annotated[str, typer.Option("--text-field", help="The text's field in JSONL / column in Parquet.")] = "text",
    dtype: Annotated[str, typer.Option("--dtype", help="auto, uint16 or uint32.")] = "auto",
    eval_fraction: Annotated[float, typer.Option("--eval-fraction", help="Share of blocks held out for evaluation.")] = 0.05,
    shard_mib: Annotated[float, typer.Option("--shard-mib", min=0.001, max=1 << 16, help="Target size of one shard file.")] = 64,
    include: Annotated[
        list[str] | None, typer.Option("--include", help="In directories, read only files matching this glob (repeatable).")
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", help="In directories, skip files matching this glob (repeatable).")
    ] = None,
) -> None:
    """Tokenize INPUTS into uint16/uint32 shards with a manifest (counts, sha256); train on it with data.corpus=OUT.

    In a directory every file that is not hidden is read if its content is text (valid UTF-8, no
    NUL byte), whatever its name; what was skipped, and why, is printed and listed in the manifest."""
    from geotrain.data.prepare import PrepareError, prepare, skipped_summary

    try:
        m = prepare(
            inputs,
            tokenizer,
            out,
            vocab_size=vocab_size,
            text_field=text_field,
            dtype=dtype,
            eval_fraction=eval_fraction,
            shard_bytes=int(shard_mib * (1 << 20)),
            include=tuple(include or ()),
            exclude=tuple(exclude or ()),
        )
    except PrepareError as exc:
        fail(f"data prepare: {exc}")
    shards = len(m["shards"]["train"]) + len(m["shards"]["eval"])
    console.print(
        f"{m['documents']:,} documents -> {m['tokens']['train']:,} train + {m['tokens']['eval']:,} eval tokens "
        f"({m['dtype']}, vocabulary {m['vocab_size']:,}, {shards} shards) in {out}; train with --set data.corpus={out}"
    )
    if m["skipped"]:
        console.print(f"{skipped_summary(m['skipped'], 'files skipped')}; {out / 'manifest.json'} lists them")


@data_app.command("verify")
def verify_cmd(
    root: Annotated[Path, typer.Argument(help="A directory written by geotrain data prepare.")],
) -> None:
    """Check a prepared directory's manifest, file sizes and every shard's sha256 (reads every byte)."""
    from geotrain.data.tokens import verify

    try:
        m = verify(root)
    except ValueError as exc:
        fail(f"data verify: {exc}")
    shards = len(m["shards"]["train"]) + len(m["shards"]["eval"])
    console.print(f"{root}: {shards} shards, {m['tokens']['train'] + m['tokens']['eval']:,} tokens, sha256 as recorded")
