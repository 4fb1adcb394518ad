"""Using what a run trained: ``generate``, ``chat`` and ``eval``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from lowmem_tpu.cli.common import app
from lowmem_tpu.errors import UserError

TrainedArg = Annotated[
    Path, typer.Argument(help="An adapter (output_dir/final) or a merged/full model directory.", show_default=False)
]
MaxNewOpt = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens",
        help="Most tokens to generate (default: 128, within the model's positions).",
        show_default=False,
    ),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="0: greedy; above 0: sampling.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Sample from the smallest set of tokens this likely.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the sampler.")]
RawOpt = Annotated[bool, typer.Option("--raw", help="The prompt as it is (no chat or Alpaca template).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="xla: the TPU or the CPU backend; cpu: plain PyTorch.")]
BaseOpt = Annotated[
    str | None, typer.Option("--base", help="An adapter's base, when not the one it records.", show_default=False)
]


def _session(directory: Path, *flags: object):
    """The session ``generate`` and ``chat`` decode with: their shared flags, in ``Options``' order."""
    from lowmem_tpu.infer.session import Options, Session

    return Session(directory, Options(*flags))  # type: ignore[arg-type]


@app.command()
def generate(
    directory: TrainedArg,
    prompt: Annotated[str, typer.Option("--prompt", help="What to complete.", show_default=False)],
    max_new_tokens: MaxNewOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    raw: RawOpt = False,
    device: DeviceOpt = "xla",
    base: BaseOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Also print tokens/s and XLA graphs compiled.")] = False,
) -> None:
    """Complete one prompt with a trained model (formatted as its run trained it); prints only the completion."""
    session = _session(directory, max_new_tokens, temperature, top_p, seed, raw, device, base)
    text, result = session.complete(prompt)
    typer.echo(text)
    if verbose:
        how = f"{session.prompt_format or 'raw'} prompt of {result.prompt_tokens} tokens"
        typer.echo(
            f"[{len(result.ids)} tokens ({result.stopped}) in {result.seconds:.2f} s, "
            f"{result.tokens_per_second:.1f} tokens/s; {how}; {session.graphs} XLA graphs compiled]",
            err=True,
        )


@app.command()
def chat(
    directory: TrainedArg,
    max_new_tokens: MaxNewOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = 0,
    raw: RawOpt = False,
    device: DeviceOpt = "xla",
    base: BaseOpt = None,
) -> None:
    """Talk to a trained model; the conversation is kept (a chat model sees it all). /reset, /exit."""
    session = _session(directory, max_new_tokens, temperature, top_p, seed, raw, device, base)
    fmt = session.prompt_format or "raw"
    memory = "the whole conversation" if fmt == "chat" else "each message on its own"
    typer.echo(f"{directory} ({fmt} prompts: the model sees {memory}). /reset starts over, /exit leaves.", err=True)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            typer.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            break
        message = line.strip()
        if message in ("/exit", "/quit"):
            break
        if message == "/reset":
            session.reset()
            typer.echo("(conversation cleared)", err=True)
            continue
        if not message:
            continue
        try:
            text, _ = session.reply(message)
        except UserError as err:
            typer.echo(f"error: {err} (/reset to start over)", err=True)
            continue
        typer.echo(text)


EvalDataOpt = Annotated[
    str | None,
    typer.Option("--data", help="A local .jsonl/.json/.csv/.parquet file or a Hub dataset id.", show_default=False),
]
EvalFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--format",
        help="text, alpaca, chat, prompt_completion, sharegpt or preference (default: the run's data.format).",
        show_default=False,
    ),
]
SplitOpt = Annotated[str | None, typer.Option("--split", help="Split of a Hub dataset.", show_default=False)]
SamplesOpt = Annotated[
    int | None,
    typer.Option(
        "--samples", help="Prompts for greedy exact match (default: the run's train.eval_samples).", show_default=False
    ),
]
TasksOpt = Annotated[
    str | None,
    typer.Option(
        "--tasks",
        help="lm-evaluation-harness tasks, comma-separated: registry names, tasks in --include-path, or "
        "builtin:reverse (the demo's, offline). Scores go into DIRECTORY/metrics.json.",
        show_default=False,
    ),
]
IncludeOpt = Annotated[
    Path | None, typer.Option("--include-path", help="A folder of lm-eval task YAML files.", show_default=False)
]
LimitOpt = Annotated[
    int | None, typer.Option("--limit", help="lm-eval: at most this many documents per task.", show_default=False)
]
FewshotOpt = Annotated[
    int | None, typer.Option("--num-fewshot", help="lm-eval: few-shot examples per prompt.", show_default=False)
]
ChatTemplateOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat-template/--no-chat-template",
        help="lm-eval: render prompts with the chat template (default: when the run trained on chat data).",
        show_default=False,
    ),
]


@app.command(name="eval")
def eval_command(
    directory: TrainedArg,
    data: EvalDataOpt = None,
    fmt: EvalFormatOpt = None,
    split: SplitOpt = None,
    samples: SamplesOpt = None,
    tasks: TasksOpt = None,
    include_path: IncludeOpt = None,
    limit: LimitOpt = None,
    num_fewshot: FewshotOpt = None,
    chat_template: ChatTemplateOpt = None,
    method: Annotated[
        str | None,
        typer.Option(
            "--method",
            help="Score --data as this method's loss and figures (default: the run's own; e.g. orpo on pairs: the "
            "share whose chosen answer is the likelier, no reference).",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the summary.")] = False,
) -> None:
    """Held-out loss, perplexity, token accuracy and greedy exact match: the numbers a run prints, for any data
    (a preference run: its method's loss, preference accuracy and reward margin, and exact match of the chosen
    answers). With --tasks: lm-evaluation-harness's tasks and scores, on the CPU."""
    import contextlib

    from lowmem_tpu.infer.score import evaluate_directory, format_scores

    if (data is None) == (tasks is None):
        raise UserError(
            "eval: give --data FILE (held-out loss and exact match) or --tasks T1,T2 (lm-eval), one of them"
        )
    # With --json, stdout carries the one JSON object: progress goes to stderr.
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    if tasks is not None:
        from lowmem_tpu.infer.harness import format_results, parse_tasks, run_tasks

        names = parse_tasks(tasks)
        with quiet:
            record = run_tasks(
                directory,
                names,
                include_path=include_path,
                limit=limit,
                num_fewshot=num_fewshot,
                chat_template=chat_template,
            )
        typer.echo(json.dumps(record) if as_json else format_results(directory, record))
        return
    with quiet:
        result = evaluate_directory(directory, data, fmt=fmt, split=split, samples=samples, method=method)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(format_scores(directory, result))
