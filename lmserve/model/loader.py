"""Open a GGUF and build everything model-side the server needs, except the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmserve.model.chat_template import ChatTemplate
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile
from lmserve.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate

    @property
    def model_id(self) -> str:
        """The id clients see: the file name without its extension."""
        return self.path.stem


def load_model(path: str | Path) -> LoadedModel:
    """Read metadata, config, tokenizer and chat template; raises ModelLoadError on a bad file."""
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)
    tokenizer = Tokenizer.from_gguf(gguf)
    template = ChatTemplate.from_gguf(gguf, tokenizer)
    return LoadedModel(Path(path), gguf, config, tokenizer, template)
