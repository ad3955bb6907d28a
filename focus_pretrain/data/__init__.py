"""Data: the embedded demo corpus, the SentencePiece tokenizer, corpora to indexed datasets."""

from focus_pretrain.data.demo_corpus import DemoSpec, demo_document, demo_documents
from focus_pretrain.data.preprocess import load_texts, tokenize_to_indexed
from focus_pretrain.data.tokenizer import LLAMA_STYLE_OPTIONS, Tokenizer, train_tokenizer

__all__ = [
    "LLAMA_STYLE_OPTIONS",
    "DemoSpec",
    "Tokenizer",
    "demo_document",
    "demo_documents",
    "load_texts",
    "tokenize_to_indexed",
    "train_tokenizer",
]
