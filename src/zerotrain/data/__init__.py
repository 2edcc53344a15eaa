"""Corpora, tokenisation and distributed sampling."""
