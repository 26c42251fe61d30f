"""Publishing a merged folder to a Hugging Face Hub: the verified, resumable upload (``upload``), the model
card it carries (``model_card``) and the card's metadata (``card_metadata``: base model, relation, license, task);
a step promoted to ``main`` (``promotion``); the client both use (``connection``).
"""
