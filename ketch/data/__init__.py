"""Data: Parquet prompt and preference datasets, chat templates, and the built-in arithmetic task and tokenizer."""

from ketch.data.builtin import build_char_tokenizer, resolve_data_files
from ketch.data.chat_templates import format_prompt, get_chat_template
from ketch.data.dataset import RLHFDataset
from ketch.data.errors import DatasetError
from ketch.data.preference_dataset import PreferenceDataset
from ketch.data.sft_dataset import SFTDataset

__all__ = [
    "DatasetError",
    "PreferenceDataset",
    "RLHFDataset",
    "SFTDataset",
    "build_char_tokenizer",
    "format_prompt",
    "get_chat_template",
    "resolve_data_files",
]
