"""Training data: Megatron-LM indexed datasets (`indexed.py`), tokenizers, preprocessing, GPT and
BERT samples, blending, and the embedded default corpus. Import the submodules directly; this
package imports nothing, so CLI tools (`tools/preprocess_data.py`) do not pay for torch."""
