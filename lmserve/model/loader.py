"""Open a GGUF and build everything model-side the server needs, except the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmserve.model.chat_template import ChatTemplate, TemplateError
from lmserve.model.config import ModelConfig
from lmserve.model.gguf_file import GGUFFile, ModelLoadError, model_stem
from lmserve.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: Path
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    template: ChatTemplate
    template_origin: str  # for the banner: embedded, ChatML fallback, or the --chat-template file
    name: str | None = None  # the name it was found by in a model store, if any
    embedded: bool = False  # the embedded demo model (no model was named)

    @property
    def model_id(self) -> str:
        """The id clients see: the name the model was asked for by, else the file name without its
        extension (and without a split model's part number)."""
        return self.name or model_stem(self.path)


def load_model(path: str | Path, name: str | None = None, chat_template: Path | None = None,
               embedded: bool = False) -> LoadedModel:
    """Read metadata, config, tokenizer and chat template (the file's, or `chat_template` in its
    place, as llama-server's --chat-template-file); raises ModelLoadError on a bad file."""
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf)
    tokenizer = Tokenizer.from_gguf(gguf)
    if chat_template is None:
        embedded = gguf.metadata.get("tokenizer.chat_template")
        template = ChatTemplate.from_gguf(gguf, tokenizer)
        origin = "embedded in the GGUF" if embedded else "ChatML (the GGUF has none)"
    else:
        try:
            source = chat_template.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read --chat-template {chat_template}: {exc}") from None
        if not source.strip():
            raise ModelLoadError(f"--chat-template {chat_template} is empty")
        try:
            template = ChatTemplate.from_gguf(gguf, tokenizer, source)
        except TemplateError as exc:
            raise ModelLoadError(f"--chat-template {chat_template}: {exc}") from None
        origin = str(chat_template)
    return LoadedModel(Path(path), gguf, config, tokenizer, template, origin, name, embedded)
