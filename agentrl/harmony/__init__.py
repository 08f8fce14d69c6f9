"""agentrl.harmony: chat formats (GPT-OSS Harmony, HF chat templates), parsing and token-exact trajectories.

Imports neither torch nor transformers; the HF pieces import transformers lazily when used.
"""

from agentrl.harmony.builder import TrajectoryBuilder
from agentrl.harmony.chat_template import ChatTemplateFormat
from agentrl.harmony.encoding import load_harmony_encoding_offline
from agentrl.harmony.factory import FORMAT_NAMES, default_format, make_format
from agentrl.harmony.format import ChatFormat
from agentrl.harmony.harmony_format import HarmonyFormat
from agentrl.harmony.harmony_parser import StreamingParser
from agentrl.harmony.hf_tokenizer import harmony_hf_tokenizer
from agentrl.harmony.trajectory import (
    ERROR_KINDS,
    SCHEMA_VERSION,
    SamplingRecord,
    ToolRecord,
    Trajectory,
    TurnRecord,
    parse_error_kind,
)
from agentrl.harmony.types import Message, ParsedTurn, ParseError, ParseErrorKind, ToolCall, ToolSpec

__all__ = [
    "ERROR_KINDS",
    "FORMAT_NAMES",
    "SCHEMA_VERSION",
    "ChatFormat",
    "ChatTemplateFormat",
    "HarmonyFormat",
    "Message",
    "ParseError",
    "ParseErrorKind",
    "ParsedTurn",
    "SamplingRecord",
    "StreamingParser",
    "ToolCall",
    "ToolRecord",
    "ToolSpec",
    "TrajectoryBuilder",
    "Trajectory",
    "TurnRecord",
    "default_format",
    "harmony_hf_tokenizer",
    "load_harmony_encoding_offline",
    "make_format",
    "parse_error_kind",
]
