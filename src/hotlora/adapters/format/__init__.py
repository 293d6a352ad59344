"""The format wing: an adapter file read (``files``), converted through diffusers' own converters
into one canonical form (``convert``: ``Adapter``, ``load_adapter``), its LoRA config derived
(``lora_config``), embeddings parsed (``embeddings``), checked against a served engine's ceiling
(``validate``) and written back in diffusers' layout (``export``). No I/O beyond the file given."""
