"""Chat data: rendered with a chat template, trained on the assistant's tokens alone."""

from __future__ import annotations

from coat_jax.convert import byte_tokenizer_hf
from coat_jax.training.data import (
    Tokenizer,
    make_tokenizer,
)

CHATS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6, of course"},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_byte_tokenizers_chat_format_marks_the_assistants_bytes_and_eos():
    tok = make_tokenizer("byte", None)
    ids, assistant = tok.encode_chat(CHATS[0], "chat")
    text = "".join(
        f"<|{m['role']}|>\n{m['content']}" + ("\x00" if m["role"] == "assistant" else "\n")
        for m in CHATS[0]
    )
    assert len(ids) == len(text.encode())
    assert tok.decode(ids[assistant]) == "46, of course"
    assert list(ids[assistant]).count(tok.eos_id) == 2  # each assistant turn ends in EOS


def test_a_chat_template_marks_the_assistants_turns():
    hf = byte_tokenizer_hf()
    hf.chat_template = CHATML
    tok = Tokenizer(hf, "byte-hf")
    ids, assistant = tok.encode_chat(CHATS[0], "chat")
    assert tok.decode(ids) == hf.apply_chat_template(CHATS[0], tokenize=False)
    assert tok.decode(ids[assistant]) == "4<|im_end|>\n6, of course<|im_end|>\n"


def test_the_byte_tokenizer_encodes_as_coat_jax_tokenizer_does():
    from coat_jax.tokenizer import ByteTokenizer

    text = "héllo wörld, 東京\n"
    ids = make_tokenizer("byte", None).encode(text)
    assert ids.dtype == "int64" and ids.tolist() == ByteTokenizer().encode(text)
