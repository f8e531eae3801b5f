"""Pure launch plans for coding agents pointed at our server: argv, the child's environment, temp files.

Nothing here touches the user's own configuration: Claude Code is configured through the child's
environment, Codex through `-c` overrides plus a temporary model catalog, Pi through a temporary agent
directory holding its models.json. The CLI writes the files, runs the child, and removes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import attrs

PROVIDER = "mlx-dspark"
KEY_VARIABLE = "MLX_DSPARK_API_KEY"
DEFAULT_TOKEN = "mlx-dspark-local"
# The user's own Anthropic key and cloud-provider switches would send Claude Code elsewhere.
CLAUDE_REMOVED = (
    "ANTHROPIC_API_KEY",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_USE_FOUNDRY",
    "ANTHROPIC_BEDROCK_BASE_URL",
    "ANTHROPIC_VERTEX_BASE_URL",
    "ANTHROPIC_VERTEX_PROJECT_ID",
    "ANTHROPIC_FOUNDRY_BASE_URL",
    "ANTHROPIC_FOUNDRY_RESOURCE",
)
# Codex requires base instructions in a catalog entry; they replace its ~17k-character built-in prompt,
# which alone would overflow a small local model's window.
CODEX_INSTRUCTIONS = (
    "You are a coding agent working in the user's workspace through the Codex CLI, served by a local model. "
    "Use the tools to inspect and change files and to run commands; keep answers short and say what you did."
)
LONG_TIMEOUT_MS = "3600000"  # local prefill of a 20k-token prompt can take minutes


@attrs.frozen(kw_only=True)
class Target:
    """The server a client is pointed at."""

    base_url: str  # http://127.0.0.1:PORT (no /v1)
    model: str
    api_key: str | None = None
    context_window: int = 32768
    max_output_tokens: int = 8192


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """What to run.

    Attributes:
        argv: the client command line.
        env: the child's whole environment.
        files: relative path (under a fresh temporary directory) → content; `{tmp}` in argv and env
            values is replaced by that directory.
        shown_env: the variables this plan sets (for --print-env).
        removed_env: variables taken out of the child's environment.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    files: Mapping[str, str] = attrs.field(factory=dict)
    shown_env: Mapping[str, str] = attrs.field(factory=dict)
    removed_env: tuple[str, ...] = ()


def _child_env(environ: Mapping[str, str], add: Mapping[str, str], remove: Sequence[str] = ()) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in remove}
    env.update(add)
    return env


def claude_plan(target: Target, args: Sequence[str], environ: Mapping[str, str], program: str = "claude") -> LaunchPlan:
    """Claude Code configured entirely through its environment (every model tier mapped to ours)."""
    m = target.model
    add = {
        "ANTHROPIC_BASE_URL": target.base_url,
        "ANTHROPIC_AUTH_TOKEN": target.api_key or DEFAULT_TOKEN,
        "ANTHROPIC_MODEL": m,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": m,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": m,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": m,
        "ANTHROPIC_SMALL_FAST_MODEL": m,
        "CLAUDE_CODE_SUBAGENT_MODEL": m,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_FEEDBACK_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "CLAUDE_CODE_TOTAL_TOKENS_REMINDER": "off",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context_window),
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(target.context_window),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.max_output_tokens),
        "API_TIMEOUT_MS": LONG_TIMEOUT_MS,
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": LONG_TIMEOUT_MS,
    }
    removed = tuple(k for k in CLAUDE_REMOVED if k in environ)
    return LaunchPlan(
        argv=(program, *args),
        env=_child_env(environ, add, CLAUDE_REMOVED),
        shown_env=add,
        removed_env=removed,
    )


def _toml(value: object) -> str:
    return json.dumps(value)  # JSON strings, numbers and booleans are valid TOML values


def codex_plan(target: Target, args: Sequence[str], environ: Mapping[str, str], program: str = "codex") -> LaunchPlan:
    """Codex with our provider given as `-c` overrides (wire_api = "responses") and a temp model catalog."""
    provider = f"model_providers.{PROVIDER}"
    overrides = {
        "model": target.model,
        "model_provider": PROVIDER,
        f"{provider}.name": "mlx-dspark (local)",
        f"{provider}.base_url": target.base_url + "/v1",
        f"{provider}.wire_api": "responses",
        f"{provider}.env_key": KEY_VARIABLE,
        f"{provider}.stream_idle_timeout_ms": 3600000,
        "model_catalog_json": "{tmp}/catalog.json",
        "check_for_update_on_startup": False,
        "analytics.enabled": False,
        "feedback.enabled": False,
        "features.plugins": False,
    }
    argv: list[str] = [program]
    for key, value in overrides.items():
        argv += ["-c", f"{key}={_toml(value)}"]
    catalog = {
        "models": [
            {
                "slug": target.model,
                "display_name": target.model,
                "description": "local model served by mlx-dspark",
                "visibility": "list",
                "supported_in_api": True,
                "priority": 0,
                "default_reasoning_level": "none",
                "default_reasoning_summary": "none",
                "support_verbosity": False,
                "base_instructions": CODEX_INSTRUCTIONS,
                "context_window": target.context_window,
                "shell_type": "default",
                "truncation_policy": {"mode": "bytes", "limit": 10000},
                "input_modalities": ["text"],
                "supports_parallel_tool_calls": False,
                "supports_reasoning_summaries": False,
                "supported_reasoning_levels": [],
                "experimental_supported_tools": [],
            }
        ]
    }
    add = {KEY_VARIABLE: target.api_key or DEFAULT_TOKEN}
    return LaunchPlan(
        argv=(*argv, *args),
        env=_child_env(environ, add),
        files={"catalog.json": json.dumps(catalog, indent=2) + "\n"},
        shown_env=add,
    )


def pi_plan(
    target: Target,
    args: Sequence[str],
    environ: Mapping[str, str],
    program: str = "pi",
    api: str = "openai-completions",
) -> LaunchPlan:
    """Pi with a temporary agent directory whose models.json names our server as a provider."""
    base = target.base_url if api == "anthropic-messages" else target.base_url + "/v1"
    models = {
        "providers": {
            PROVIDER: {
                "baseUrl": base,
                "api": api,
                "apiKey": target.api_key or DEFAULT_TOKEN,
                "compat": {"supportsDeveloperRole": False, "maxTokensField": "max_tokens"},
                "models": [
                    {
                        "id": target.model,
                        "name": f"{target.model} (mlx-dspark)",
                        "reasoning": False,
                        "input": ["text"],
                        "contextWindow": target.context_window,
                        "maxTokens": target.max_output_tokens,
                    }
                ],
            }
        }
    }
    add = {"PI_CODING_AGENT_DIR": "{tmp}/agent", "PI_OFFLINE": "1"}
    return LaunchPlan(
        argv=(program, "--provider", PROVIDER, "--model", target.model, *args),
        env=_child_env(environ, add),
        files={"agent/models.json": json.dumps(models, indent=2) + "\n"},
        shown_env=add,
    )


PLANS = {"claude": claude_plan, "codex": codex_plan, "pi": pi_plan}
