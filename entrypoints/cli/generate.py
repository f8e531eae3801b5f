"""`mlx-dspark generate`: stream text for one prompt to the terminal, or print one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence

import attrs

from mlx_dspark.application.generation import GenerationDone, GenerationRequest, TextChunk
from mlx_dspark.application.modes import build_generator
from mlx_dspark.domain.tokens import SamplingParams
from mlx_dspark.entrypoints.cli.common import add_model_args, run_guarded, settings_from, start
from mlx_dspark.entrypoints.cli.progress import ProgressBar


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-dspark generate", description="Generate text losslessly faster.")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    add_model_args(p)
    p.add_argument("--max-tokens", type=int, help="hard cap on generated tokens (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, help="sample from the fewest tokens holding this probability (1 = off)")
    p.add_argument("--top-k", type=int, help="sample from the K most likely tokens only (0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same tokens (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", help="system prompt (chat template only)")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary line, only the text")
    return p


def ran_on(source_rounds: Mapping[str, int]) -> str:
    """Where an auto request's rounds went, most first: "dspark 30 rounds, lookup 4, baseline 2"."""
    ranked = sorted(source_rounds.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{name} {n}" + (" rounds" if i == 0 else "") for i, (name, n) in enumerate(ranked))


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    as_json, stops, system, raw = args.json, tuple(args.stop), args.system, args.no_chat_template
    bar = ProgressBar(quiet=args.quiet)
    for name in ("prompt", "json", "stop", "system", "no_chat_template", "quiet"):
        delattr(args, name)

    def body() -> int:
        settings = settings_from(args)
        services = start(settings, quiet_logs=True)
        gen = build_generator(services, settings, progress=bar.note, fraction=bar.update)
        d = settings.decode
        sampling = SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k, seed=d.seed)
        prompt: object = prompt_text
        if system and not raw:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt_text}]
        request = GenerationRequest(
            prompt=prompt,  # type: ignore[arg-type]
            max_tokens=d.max_tokens,
            sampling=sampling,
            stop=stops,
            chat_template=not raw,
        )
        for event in gen.stream(request):
            if isinstance(event, TextChunk) and not as_json:
                bar.close()  # the text takes the bar's place on the terminal
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, GenerationDone):
                r = event.result
                bar.close()
                if as_json:
                    out = attrs.asdict(r)
                    out["token_ids"] = list(r.token_ids)
                    sys.stdout.write(json.dumps(out) + "\n")
                else:
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    ran = f" ({ran_on(r.source_rounds)})" if len(r.source_rounds) > 1 else ""
                    ran = ran or (f" ({r.source})" if r.source != r.mode else "")
                    bar.note(
                        f"{r.generated_tokens} tokens, {r.tokens_per_second:.1f} tok/s, mode {r.mode}{ran}, "
                        f"{r.mean_accepted:.2f} per round, finish {r.finish_reason}"
                    )
        services.prefix_caches.flush()  # with --prefix-cache-dir, the next run starts from this prompt
        return 0

    try:
        return run_guarded(body)
    finally:
        bar.close()
