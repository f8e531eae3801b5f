"""Picks the family codec from the model type and its chat template (never from generated text)."""

from __future__ import annotations

from mlx_dspark.adapters.families.base import FamilyCodec
from mlx_dspark.adapters.families.gemma import THINK as GEMMA_THINK
from mlx_dspark.adapters.families.gemma import Gemma4Codec
from mlx_dspark.adapters.families.hermes import HermesCodec
from mlx_dspark.adapters.families.lfm2 import Lfm2Codec
from mlx_dspark.adapters.families.minicpm import MiniCpm5Codec
from mlx_dspark.adapters.families.muse import MuseCodec
from mlx_dspark.adapters.families.qwen_xml import QwenXmlCodec

THINK = ("<think>", "</think>")


def select_codec(family: str, chat_template: str | None) -> FamilyCodec:
    """The codec for a model.

    Args:
        family: the HF model_type (e.g. "qwen3", "gemma3", "lfm2", "llama").
        chat_template: the tokenizer's chat template source, if any.

    Returns:
        A codec whose markers match what this template renders; templates that cannot render tools get
        the Hermes text fallback (tools described in the system prompt).
    """
    tmpl = chat_template or ""
    fam = family.lower()
    think = THINK if ("<think>" in tmpl or fam.startswith("qwen3")) else None
    native = "tools" in tmpl
    if "<function=" in tmpl and "<parameter=" in tmpl:
        return QwenXmlCodec(native_tools=native, think=think)
    if "<|tool_call>" in tmpl or fam.startswith("gemma4"):
        return Gemma4Codec(native_tools=native, think=GEMMA_THINK)
    if "<|tool_call_start|>" in tmpl or fam.startswith("lfm2"):
        # LFM2 templates print only `content` for assistant turns, so earlier calls go in as text
        return Lfm2Codec(native_tools=native, think=think, calls_in_content=True)
    if '<function name="' in tmpl and '<param name="' in tmpl:
        return MiniCpm5Codec(native_tools=native, think=think)
    if "<atem:function_calls>" in tmpl:
        return MuseCodec(native_tools=native, think=think)
    if "<tool_call>" in tmpl:
        return HermesCodec(native_tools=native, think=think)
    return HermesCodec(native_tools=False, think=think)
