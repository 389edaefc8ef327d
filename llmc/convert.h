// --convert SRC --to PATH: a model moved between the formats the trainer reads, with nothing trained: a
// checkpoint's model (verified first), an llm.c model file or a Hugging Face directory in, an llm.c file or a
// Hugging Face directory out. A command of its own, apart from the run: it opens no ranks and no device, and
// leaves no half-written file behind. The formats themselves are llmc/model_file.h's (llm.c's files) and llmc/hf.h's.
#pragma once

#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "llmc/checkpoint.h"
#include "llmc/gpt.cuh"
#include "llmc/hf.h"
#include "llmc/options.h"
#include "llmc/utils.h"

// the model a checkpoint's run was started from (its manifest's model_source: -e's absolute path, or a descriptor;
// in a manifest written before it was made absolute, -e as the run was given it), or "" where the manifest does not
// say (a checkpoint saved before it was recorded)
inline std::string checkpoint_model_source(const std::string& manifest) {
    File f(manifest, "rb");
    std::vector<std::string> source = manifest_values(f.read_all(), "model_source");
    int n = 0;
    unsigned long long sum;
    if (source.size() == 1 && sscanf(source[0].c_str(), "file fnv1a64=%llx %n", &sum, &n) == 1 && n > 0)
        return source[0].substr(n);
    return source.size() == 1 && source[0].rfind("descriptor ", 0) == 0 ? source[0].substr(11) : "";
}

// The tokenizer files of the Hugging Face directory the model came from (hf_tokenizer_files). An older manifest's
// relative model_source is looked for from here, where the run may not have been started: not found, it is a note.
inline std::vector<std::string> tokenizer_files_of(const std::string& model_source) {
    struct stat st;
    if (!model_source.empty() && model_source[0] != '/' && !is_model_descriptor(model_source) &&
        stat(model_source.c_str(), &st) != 0) {
        char here[4096];
        printf("note: no tokenizer files copied: the model came from %s, relative to where its run was started, "
               "which is not found from %s\n",
               model_source.c_str(), getcwd(here, sizeof(here)) ? here : "here");
        return {};
    }
    return hf_tokenizer_files(model_source);
}

// --convert SRC --to PATH: the model of a checkpoint (verified first), a model file or a Hugging Face directory,
// as an llm.c file of its own or (--format hf) a Hugging Face directory; written under a temporary name and
// renamed, never over an existing file or directory
inline int convert_model(const Options& o) {
    std::string src = o.convert, model_path = src;
    while (src.size() > 1 && src.back() == '/') src.pop_back();
    struct stat st;
    if (stat(src.c_str(), &st) != 0) fail("--convert %s: %s", o.convert.c_str(), strerror(errno));
    int step = -1;  // a checkpoint's
    bool hf = is_hf_dir(src);
    std::string model_source = src;  // where the model came from: src, or the -e of the run that saved src
    if (S_ISDIR(st.st_mode) && !hf) {
        size_t slash = src.rfind('/');
        std::string parent = slash == std::string::npos ? "." : src.substr(0, slash), name = src.substr(slash + 1);
        if (!is_checkpoint_name(name, &step))
            fail("--convert %s: neither a model file, a Hugging Face directory nor a checkpoint directory (ckpt_STEP, "
                 "under a run's -o)",
                 o.convert.c_str());
        verify_checkpoint(parent, step);
        model_path = src + "/model.bin";
        model_source = checkpoint_model_source(src + "/manifest.txt");
    }
    if (access(o.convert_to.c_str(), F_OK) == 0)
        fail("--to %s: already exists; name a new %s (an existing one is never replaced)", o.convert_to.c_str(),
             o.convert_format == "hf" ? "directory" : "file");
    int version;
    GPTConfig config = hf ? hf_read_config(src) : read_model_header(model_path, &version);
    std::vector<float> params(num_parameters(config));
    if (hf) hf_load(config, params.data(), src);
    else gpt_load_params(config, params.data(), model_path);
    std::string what = step >= 0 ? strfmt("the model of %s (step %d, %zu parameters)", src.c_str(), step, params.size())
                                 : strfmt("%s %s (%zu parameters)", hf ? "Hugging Face directory" : "model file",
                                          src.c_str(), params.size());
    // both formats are written to TO.tmp and renamed: a write that fails (a full disk) leaves neither behind
    std::string tmp = o.convert_to + ".tmp";
    int files = 0;
    try {
        if (o.convert_format == "hf") {
            hf_placements(config);  // a model Hugging Face has no form for is refused before the tokenizer's notes
            files = hf_save(config, params.data(), o.convert_to, o.convert_dtype, HF_SHARD_BYTES,
                            tokenizer_files_of(model_source));
        } else {
            version = o.convert_dtype == "bf16" ? MODEL_VERSION_BF16 : MODEL_VERSION_FP32;
            gpt_save_params(config, params.data(), tmp, version);
            if (rename(tmp.c_str(), o.convert_to.c_str()) != 0)
                fail("--to %s: cannot rename %s into place (%s)", o.convert_to.c_str(), tmp.c_str(), strerror(errno));
        }
    } catch (const Error&) {
        remove_tree(tmp);
        throw;
    }
    if (o.convert_format == "hf") {
        printf("wrote %s: %s as a Hugging Face %s in %s, %d safetensors file%s\n", o.convert_to.c_str(), what.c_str(),
               hf_architecture(config),
               o.convert_dtype == "bf16" ? "bfloat16" : "float32", files, files == 1 ? "" : "s");
        return 0;
    }
    printf("wrote %s: %s as an llm.c %s file (version %d)\n", o.convert_to.c_str(), what.c_str(),
           o.convert_dtype.c_str(), version);
    return 0;
}
