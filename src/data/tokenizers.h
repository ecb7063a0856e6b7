#pragma once
// The tokenizer kinds behind data::load_tokenizer (internal).

#include <memory>
#include <string>

#include "meshtrain/data.h"

namespace meshtrain {
namespace data {

std::unique_ptr<Tokenizer> make_byte_tokenizer();
// A SentencePiece .model file (sentencepiece.cpp).
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& model_path);
// GPT-2's vocabulary and merges in `dir` (gpt2_bpe.cpp).
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& dir);

}  // namespace data
}  // namespace meshtrain
