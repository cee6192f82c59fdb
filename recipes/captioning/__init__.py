"""What only the captioning recipe needs: `data` (the three caption layouts, the decoded and
tokenized Arrow cache, batching), `tokenizer` (the word-level tokenizer trained on the captions),
`model` (the ViT encoder and causal decoder, greedy decoding) and `example` (synthetic shapes).
"""
