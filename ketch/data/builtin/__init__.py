"""Built-in data: the arithmetic task and the character-level tokenizer."""

from ketch.data.builtin.arithmetic import (
    DATA_SOURCE,
    ArithmeticTask,
    generate_arithmetic_task,
    write_arithmetic_task,
)
from ketch.data.builtin.files import resolve_data_files
from ketch.data.builtin.tokenizer import build_char_tokenizer

__all__ = [
    "DATA_SOURCE",
    "ArithmeticTask",
    "build_char_tokenizer",
    "generate_arithmetic_task",
    "resolve_data_files",
    "write_arithmetic_task",
]
