"""Where the shared fixtures are: ``../shared`` beside the checkout (the Megatron-LM checkpoints and their
tokenizer, ../shared/fixtures/megatron/README), found from this file, never by an absolute path."""

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
MEGATRON_FIXTURES = SHARED / "fixtures" / "megatron"
