// llama-graph-logits: runs llama.cpp (libllama) on given token ids and prints the
// top-k logits of every step as JSON, in llama-graph's common step format
// (tests/reference/README.md), so that llama.cpp can be compared with llama-graph
// and with the float references on identical inputs.
//
//   llama-graph-logits -m MODEL --prompt-tokens 1,2,3 [-n STEPS] [--teacher 4,5,...]
//                      [-t THREADS] [-c CTX] [-b CHUNK] [--top K] [--logits-bin PATH]
//                      [--f32-attention]
//
// steps[0] holds the logits at the last prompt position (the prompt is fed in chunks of
// CHUNK tokens); steps[i] those of the i-th single-token call, whose input is
// generated_tokens[i-1] (greedy) or, with --teacher, teacher[i-1]. generated_tokens[i]
// is the argmax of steps[i] (ties: lowest id). --logits-bin also writes every step's
// whole logit vector (STEPS x n_vocab little-endian f32) to PATH. --f32-attention keeps
// the KV cache in f32 and flash attention off (llama.cpp's defaults on CPU are an f16
// cache and flash attention, which both round to f16), for comparisons at f32 precision.
//
//   llama-graph-logits -m MODEL --tokenize-hex FILE [--no-parse-special]
//
// only loads the vocabulary and tokenizes each line of FILE (a UTF-8 string written
// as hex, so that any text fits on one line) without BOS, special tokens parsed unless
// --no-parse-special, printing {"tokens":[[ids of line 1],...]}.
#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::vector<llama_token> parse_ids(const char * s) {
    std::vector<llama_token> v;
    const char * p = s;
    while (*p) {
        char * end = nullptr;
        long id = std::strtol(p, &end, 10);
        if (end == p) {
            std::fprintf(stderr, "bad token id list: %s\n", s);
            std::exit(2);
        }
        v.push_back((llama_token) id);
        p = end;
        if (*p == ',') {
            p++;
        }
    }
    return v;
}

static std::string unhex(const std::string & h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) {
        out.push_back((char) std::strtol(h.substr(i, 2).c_str(), nullptr, 16));
    }
    return out;
}

// --tokenize-hex: see the top of the file.
static int tokenize_lines(const char * model_path, const char * path, bool parse_special) {
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        std::fprintf(stderr, "cannot load %s\n", model_path);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    FILE * f = std::fopen(path, "rb");
    if (!f) {
        std::fprintf(stderr, "cannot read %s\n", path);
        return 1;
    }
    std::string line;
    std::printf("{\"tokens\":[");
    bool first = true;
    for (int c; (c = std::fgetc(f)) != EOF || !line.empty();) {
        if (c != '\n' && c != EOF) {
            line.push_back((char) c);
            continue;
        }
        std::string text = unhex(line);
        line.clear();
        int n = -llama_tokenize(vocab, text.data(), (int) text.size(), nullptr, 0, false, parse_special);
        std::vector<llama_token> ids(std::max(n, 0));
        if (n > 0 && llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), n, false,
                                    parse_special) != n) {
            std::fprintf(stderr, "llama_tokenize failed\n");
            return 1;
        }
        std::printf("%s[", first ? "" : ",");
        for (size_t i = 0; i < ids.size(); i++) {
            std::printf("%s%d", i ? "," : "", ids[i]);
        }
        std::printf("]");
        first = false;
        if (c == EOF) {
            break;
        }
    }
    std::printf("]}\n");
    std::fclose(f);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

static void print_step(const float * logits, int n_vocab, int top_k, bool first) {
    std::vector<int> idx(n_vocab);
    for (int i = 0; i < n_vocab; i++) {
        idx[i] = i;
    }
    std::partial_sort(idx.begin(), idx.begin() + top_k, idx.end(), [&](int a, int b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    std::printf("%s{\"top\":[", first ? "" : ",");
    for (int i = 0; i < top_k; i++) {
        std::printf("%s[%d,%.9g]", i ? "," : "", idx[i], (double) logits[idx[i]]);
    }
    std::printf("],\"top2_gap\":%.9g}", (double) (logits[idx[0]] - logits[idx[1]]));
}

static int argmax(const float * logits, int n_vocab) {
    int best = 0;
    for (int i = 1; i < n_vocab; i++) {
        if (logits[i] > logits[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    const char * model_path = nullptr;
    const char * bin_path = nullptr;
    const char * tokenize_path = nullptr;
    bool parse_special = true;
    bool f32_attention = false;
    std::vector<llama_token> prompt, teacher;
    int steps = 1, threads = 1, n_ctx = 0, chunk = 512, top_k = 10;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> const char * {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "%s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "-m") model_path = next();
        else if (a == "--prompt-tokens") prompt = parse_ids(next());
        else if (a == "--teacher") teacher = parse_ids(next());
        else if (a == "-n") steps = std::atoi(next());
        else if (a == "-t") threads = std::atoi(next());
        else if (a == "-c") n_ctx = std::atoi(next());
        else if (a == "-b") chunk = std::atoi(next());
        else if (a == "--top") top_k = std::atoi(next());
        else if (a == "--logits-bin") bin_path = next();
        else if (a == "--tokenize-hex") tokenize_path = next();
        else if (a == "--no-parse-special") parse_special = false;
        else if (a == "--f32-attention") f32_attention = true;
        else {
            std::fprintf(stderr, "unknown argument %s\n", a.c_str());
            return 2;
        }
    }
    if (model_path && tokenize_path) {
        return tokenize_lines(model_path, tokenize_path, parse_special);
    }
    if (!model_path || prompt.empty() || steps < 1 || chunk < 1 || top_k < 2) {
        std::fprintf(stderr, "usage: %s -m MODEL --prompt-tokens IDS [-n STEPS] [--teacher IDS] "
                             "[-t THREADS] [-c CTX] [-b CHUNK] [--top K]\n", argv[0]);
        return 2;
    }
    if (!teacher.empty() && (int) teacher.size() < steps - 1) {
        std::fprintf(stderr, "--teacher needs at least %d ids\n", steps - 1);
        return 2;
    }
    if (n_ctx == 0) {
        n_ctx = (int) prompt.size() + steps + 8;
    }

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        std::fprintf(stderr, "cannot load %s\n", model_path);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = chunk;
    cp.n_ubatch = chunk;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.no_perf = true;
    if (f32_attention) {
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    top_k = std::min(top_k, n_vocab);

    llama_batch batch = llama_batch_init(chunk, 0, 1);
    auto decode = [&](const llama_token * toks, int n, int pos0, bool want_last) {
        batch.n_tokens = n;
        for (int i = 0; i < n; i++) {
            batch.token[i] = toks[i];
            batch.pos[i] = pos0 + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = want_last && i == n - 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama_decode failed at position %d\n", pos0);
            std::exit(1);
        }
    };
    const int np = (int) prompt.size();
    for (int p = 0; p < np; p += chunk) {
        int n = std::min(chunk, np - p);
        decode(prompt.data() + p, n, p, p + n == np);
    }
    std::vector<int> generated;
    FILE * bin = nullptr;
    if (bin_path && !(bin = std::fopen(bin_path, "wb"))) {
        std::fprintf(stderr, "cannot write %s\n", bin_path);
        return 1;
    }
    std::printf("{\"prompt_tokens\":[");
    for (int i = 0; i < np; i++) {
        std::printf("%s%d", i ? "," : "", prompt[i]);
    }
    std::printf("],\"steps\":[");
    for (int s = 0; s < steps; s++) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        print_step(logits, n_vocab, top_k, s == 0);
        if (bin && std::fwrite(logits, sizeof(float), n_vocab, bin) != (size_t) n_vocab) {
            std::fprintf(stderr, "short write to %s\n", bin_path);
            return 1;
        }
        generated.push_back(argmax(logits, n_vocab));
        if (s + 1 < steps) {
            llama_token next = teacher.empty() ? generated.back() : teacher[s];
            decode(&next, 1, np + s, true);
        }
    }
    std::printf("],\"generated_tokens\":[");
    for (size_t i = 0; i < generated.size(); i++) {
        std::printf("%s%d", i ? "," : "", generated[i]);
    }
    std::printf("]}\n");
    if (bin) {
        std::fclose(bin);
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
