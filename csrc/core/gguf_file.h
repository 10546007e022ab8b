// A GGUF file opened read-only: metadata through ggml's gguf API, tensor bytes through mmap.
// Every getter validates and throws pdf::format_error naming the file, key/tensor, expected and actual.
#pragma once

#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace pdf {

class gguf_file {
  public:
    // metadata_only: tensor data need not be present (the memory planner reads shapes and types only)
    explicit gguf_file(const std::string & path, bool metadata_only = false);
    // a plan's file becomes a load's: from now on every tensor's bytes must lie inside it (a file_error naming
    // the first that does not)
    void require_data();
    ~gguf_file();
    gguf_file(const gguf_file &)             = delete;
    gguf_file & operator=(const gguf_file &) = delete;

    const std::string & path() const { return path_; }
    std::string         arch() const;  // general.architecture

    bool has_key(const std::string & key) const;

    // typed getters; the *_or variants return `def` when the key is absent (and still check its type)
    uint32_t              u32(const std::string & key) const;
    uint32_t              u32_or(const std::string & key, uint32_t def) const;
    float                 f32(const std::string & key) const;
    float                 f32_or(const std::string & key, float def) const;
    bool                  boolean_or(const std::string & key, bool def) const;
    std::string           str(const std::string & key) const;
    std::vector<int32_t>  i32_array(const std::string & key) const;  // any integer array type
    std::vector<bool>     bool_array(const std::string & key) const;

    // range-checked getters: a value outside [lo, hi] (floats: not finite, or outside the open interval
    // (lo, hi)) is a format_error naming the key, the value and the range
    uint32_t u32_in(const std::string & key, uint32_t lo, uint32_t hi) const;
    uint32_t u32_in_or(const std::string & key, uint32_t def, uint32_t lo, uint32_t hi) const;
    float    f32_in(const std::string & key, float lo, float hi) const;
    float    f32_in_or(const std::string & key, float def, float lo, float hi) const;

    // a per-layer value given as one integer (every layer's) or an integer array of exactly n_layer entries (as
    // llama.cpp's get_key_or_arr reads it), each checked against [lo, hi]; a format_error names the key, the entry
    // and the value
    std::vector<uint32_t> u32_per_layer_in(const std::string & key, int n_layer, uint32_t lo, uint32_t hi) const;

    // 1 + the highest N of the `blk.N.*` tensors (0 when there are none)
    int n_blocks_present() const;
    // the block count `key`, checked against the `blk.N.*` tensors: every layer it names is present (its last
    // `n_optional_last` may be absent: Qwen3.5's MTP blocks) and no layer is present that it leaves out
    int block_count(const std::string & key, uint32_t n_optional_last = 0) const;
    static constexpr int MAX_BLOCKS = 4096;  // layers a block count may name (the largest models have ~100)

    // tensors: metadata lives in a no-alloc ggml context, data in the mapped file
    ggml_tensor * find_tensor(const std::string & name) const;  // nullptr when absent
    // the tensor, checked to exist and to have exactly the shape `ne` (ggml order); 1-D tensors must be F32
    ggml_tensor * require_tensor(const std::string & name, std::initializer_list<int64_t> ne) const;
    ggml_tensor * optional_tensor(const std::string & name, std::initializer_list<int64_t> ne) const;
    const void *  tensor_data(const ggml_tensor * t) const;
    size_t        n_tensors() const;
    // the parsed metadata, for readers of arbitrary keys (the tokenizer)
    const gguf_context * metadata() const { return gguf_; }

  private:
    void    release();
    void    check_tensor_bounds() const;
    int64_t key_id(const std::string & key) const;  // -1 when absent
    void    check_shape(ggml_tensor * t, std::initializer_list<int64_t> ne) const;

    std::string    path_;
    bool           metadata_only_ = false;
    gguf_context * gguf_ = nullptr;
    ggml_context * meta_ = nullptr;
    void *         map_  = nullptr;
    size_t         size_ = 0;
};

}  // namespace pdf
