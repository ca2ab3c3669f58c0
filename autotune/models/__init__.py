"""torch-side model code: what is trained and how a strategy is applied to it. The reference decoders
built from a ModelSpec (``reference``, the only module importing torch at import), the three model
sources of a profiled job (``sources``: reference, Hugging Face config, user factory), activation
checkpointing of any nn.Module (``checkpointing``: ``apply_checkpointing``, the model-side half of a
front point), an fsdp2 strategy applied to a model with its ready-to-paste snippet (``fsdp2``) and
long-context training of Hugging Face models (``long_context``: Ulysses, tiled loss / MLP, activation
offload, ``apply_long_context``)."""
