//! Tokenizers.
