// Tests that the command lines the documentation shows run as written: every `./train_gpt ...` line in a code
// block of README.md and of the pages of docs/ (with its launcher's `-np N` as --world N) and the launch lines of
// the training scripts are dry-run with --plan, which checks every flag, the model and the layout without
// training; and that every link between those pages reaches a file and a heading. Also the helper scripts a
// newcomer meets first: plot_log.py draws main.log files, and install_deps.sh, without root and sudo, names what
// is missing in one line.
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "llmc/gpt.cuh"
#include "llmc/hf.h"
#include "test_helpers.h"

namespace test_commands {

std::string slurp(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

std::string absolute(const std::string& path) {
    char buf[4096];
    REQUIRE(getcwd(buf, sizeof(buf)) != nullptr);
    return std::string(buf) + "/" + path;
}

// the documentation: README.md and every page of docs/
std::vector<std::string> doc_pages() {
    std::vector<std::string> pages = {"README.md"};
    for (const std::string& name : list_dir("docs"))
        if (name.size() > 3 && name.compare(name.size() - 3, 3, ".md") == 0) pages.push_back("docs/" + name);
    return pages;
}

// the pages that show ./train_gpt commands: one missing, or showing none, means a page moved or its commands
// stopped being found, and the test would check nothing of it
const std::vector<std::string> pages_with_commands = {"docs/usage.md",    "docs/parallelism.md", "docs/architectures.md",
                                                      "docs/gpu.md",      "docs/fp8.md",         "docs/data.md",
                                                      "docs/planning.md"};

// one `./train_gpt` command of a page: the page, its line, the launcher's rank count (1 without one), its flags
struct DocCommand {
    std::string page;
    std::string line;
    int ranks = 1;
    std::string args;
};

// every line of a fenced code block that runs ./train_gpt; a trailing backslash joins the next line, and a
// comment (" #") ends the command
std::vector<DocCommand> doc_commands(const std::string& page, const std::string& text) {
    std::vector<DocCommand> commands;
    std::istringstream in(text);
    std::string line, joined;
    bool fenced = false;
    while (std::getline(in, line)) {
        if (line.rfind("```", 0) == 0) {
            fenced = !fenced;
            continue;
        }
        if (!fenced) continue;
        if (!line.empty() && line.back() == '\\') {
            joined += line.substr(0, line.size() - 1) + " ";
            continue;
        }
        line = joined + line;
        joined.clear();
        size_t at = line.find("./train_gpt");
        if (at == std::string::npos) continue;
        DocCommand c;
        c.page = page;
        c.line = line;
        size_t comment = line.find(" #", at);
        c.args = line.substr(at + strlen("./train_gpt"), comment == std::string::npos ? std::string::npos : comment - at - strlen("./train_gpt"));
        std::smatch np;
        std::string launcher = line.substr(0, at);
        if (std::regex_search(launcher, np, std::regex(R"((mpirun|srun)\b.*\s-(np|n)\s+(\d+))"))) c.ranks = std::stoi(np[3]);
        commands.push_back(c);
    }
    return commands;
}

std::vector<std::string> words(const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> w;
    std::string x;
    while (in >> x) w.push_back(x);
    return w;
}

// a small model in llm.c's file format, standing in for a model file a command names that only its user has
// (llm.c's gpt2_124M.bin): the dry run checks the command, not the weights
void write_stand_in_model(const std::string& path) {
    GPTConfig c = parse_model_descriptor("d2c64h2");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 1);
    gpt_save_params(c, params.data(), path);
}

// a small Llama as a Hugging Face directory, standing in for one a command names (Llama 3.2 1B's), or for a command
// that splits experts, a small Qwen3-MoE (Qwen3-30B-A3B's: 8 experts here, a dense layer and a sparse one); both
// take the commands' longest sequences
void write_stand_in_hf_dir(const std::string& path, bool experts) {
    GPTConfig c = parse_model_descriptor(experts ? "q2c64h4g2d16f128t8192e8k2x32n1" : "l2c64h4g2f128t8192");
    std::vector<float> params(num_parameters(c));
    gpt_init_random(c, params.data(), 1);
    hf_save(c, params.data(), path, "fp32");
}

TEST_CASE("every ./train_gpt line in README.md and docs/ runs as written, dry-run with --plan (--search and --calibrate as they are)",
          "[commands]") {
    REQUIRE(file_exists("./train_gpt"));
    const std::string train_gpt = absolute("train_gpt");
    std::vector<DocCommand> commands;
    for (const std::string& page : doc_pages()) {
        std::vector<DocCommand> found = doc_commands(page, slurp(page));
        commands.insert(commands.end(), found.begin(), found.end());
    }
    for (const std::string& page : pages_with_commands) {
        INFO(page);
        REQUIRE(file_exists(page));
        CHECK(std::count_if(commands.begin(), commands.end(), [&](const DocCommand& c) { return c.page == page; }) > 0);
    }
    // the pages have many; finding few means the extraction broke, not that the pages are fine
    REQUIRE(commands.size() >= 8);
    int launched = 0;
    for (const DocCommand& c : commands) {
        INFO(c.page << ": " << c.line);
        TempDir dir;  // the command's relative paths (-o out, data/...) land here, not in the repository
        std::vector<std::string> w = words(c.args);
        auto has = [&](const char* flag) { return std::find(w.begin(), w.end(), flag) != w.end(); };
        // a conversion has no dry run: its line (the fine-tune path's) runs in test_hf.cu's fine-tune case
        if (std::find(w.begin(), w.end(), "--convert") != w.end()) continue;
        for (size_t i = 0; i + 1 < w.size(); i++) {
            if (w[i] != "-e") continue;
            if (w[i + 1].size() > 4 && w[i + 1].compare(w[i + 1].size() - 4, 4, ".bin") == 0)
                write_stand_in_model(dir / w[i + 1]);
            else if (!is_model_descriptor(w[i + 1]))
                write_stand_in_hf_dir(dir / w[i + 1], has("--ep"));
        }
        // the hardware profiles where a command run from the repository finds them
        REQUIRE(system(strfmt("mkdir -p '%s/dev' && ln -s '%s' '%s/dev/hardware'", dir.path.c_str(),
                              absolute("dev/hardware").c_str(), dir.path.c_str()).c_str()) == 0);
        // --search is a dry run of its own; --calibrate runs as written (on one rank: its collectives need more)
        std::string expected = has("--search") ? "layouts considered" : has("--calibrate") ? "matmul_tflops" : "predicted memory per rank";
        std::string dry = c.args;
        if (!has("--plan") && !has("--search") && !has("--calibrate")) dry += " --plan";
        if (c.ranks > 1 && !has("--world") && !has("--calibrate")) dry += strfmt(" --world %d", c.ranks);
        launched += c.ranks > 1;
        // the timeout only stops a hung run, as the mpirun runs' 600 s does (test/mpi_helpers.h): the --search of
        // 64 GPUs takes 50 CPU-seconds, and shares its core with the other shards (past 120 s on a busy 2-core machine)
        CommandResult r = run_command(strfmt("cd '%s' && timeout 600 '%s' %s", dir.path.c_str(), train_gpt.c_str(), dry.c_str()));
        INFO("dry run: ./train_gpt " << dry << "\nexit status " << r.status << ", output:\n" << r.output);
        CHECK(r.status == 0);
        CHECK(r.output.find(expected) != std::string::npos);
    }
    CHECK(launched >= 2);  // the mpirun lines were found and planned for their rank count
}

// GitHub's anchor of a heading: lower case, letters, digits, spaces, '-' and '_' kept, spaces turned into '-'
std::string heading_anchor(const std::string& heading) {
    std::string a;
    for (char ch : heading) {
        if (std::isalnum((unsigned char)ch) || ch == '-' || ch == '_') a += (char)std::tolower((unsigned char)ch);
        else if (ch == ' ') a += '-';
    }
    return a;
}

// a page's lines outside its code blocks
std::vector<std::string> prose_lines(const std::string& text) {
    std::vector<std::string> lines;
    std::istringstream in(text);
    std::string line;
    bool fenced = false;
    while (std::getline(in, line)) {
        if (line.rfind("```", 0) == 0) fenced = !fenced;
        else if (!fenced) lines.push_back(line);
    }
    return lines;
}

// the anchors of a page's headings
std::set<std::string> page_anchors(const std::string& text) {
    std::set<std::string> anchors;
    const std::regex heading(R"(#+ (.*))");
    for (const std::string& line : prose_lines(text)) {
        std::smatch m;
        if (std::regex_match(line, m, heading)) anchors.insert(heading_anchor(m[1]));
    }
    return anchors;
}

TEST_CASE("every link of README.md and docs/ reaches a file, and a heading of it where it names one", "[commands]") {
    int links = 0;
    for (const std::string& page : doc_pages()) {
        // the links outside code blocks: [text](target), target a path relative to the page, maybe #anchor
        const std::string dir = page.find('/') == std::string::npos ? "" : page.substr(0, page.rfind('/') + 1);
        const std::regex link(R"(\]\(([^)\s]+)\))");
        for (const std::string& line : prose_lines(slurp(page))) {
            for (std::sregex_iterator it(line.begin(), line.end(), link), end; it != end; ++it) {
                std::string target = (*it)[1];
                if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0) continue;
                INFO(page << ": (" << target << ")");
                links++;
                size_t hash = target.find('#');
                std::string file = hash == 0 ? page : dir + target.substr(0, hash);
                REQUIRE(file_exists(file));
                if (hash != std::string::npos) CHECK(page_anchors(slurp(file)).count(target.substr(hash + 1)) == 1);
            }
        }
    }
    CHECK(links >= 50);  // README's table and the pages link each other; few means the search broke
}

TEST_CASE("the launch scripts' train_gpt lines run as written, dry-run with --plan under a stand-in launcher",
          "[commands]") {
    REQUIRE(file_exists("./train_gpt"));
    TempDir dir;
    // mpirun's stand-in: drops the launcher's flags and runs "./train_gpt FLAGS --plan --world NP" instead
    const std::string launcher = dir / "plan_launcher";
    {
        std::ofstream f(launcher);
        f << "#!/usr/bin/env bash\n"
             "np=1\n"
             "while [ $# -gt 0 ] && [ \"$1\" != ./train_gpt ]; do\n"
             "    if [ \"$1\" = -np ]; then np=$2; shift; fi\n"
             "    shift\n"
             "done\n"
             "shift\n"
             "exec ./train_gpt \"$@\" --plan --world \"$np\"\n";
    }
    REQUIRE(chmod(launcher.c_str(), 0755) == 0);
    {
        std::ofstream hosts(dir / "hostfile");
        hosts << "node001 slots=8\nnode002 slots=8\n";
    }
    // DEVICE=cpu: the CPU device is the one this machine plans for (the scripts default to cuda)
    const std::string env = strfmt("MPIRUN='%s' DEVICE=cpu OUT_DIR='%s' ", launcher.c_str(), (dir / "log").c_str());
    struct Script {
        std::string command;
        int ranks;
    };
    for (const Script& s : {Script{"BUILD=0 scripts/run_gpt2_124M.sh", 8},
                            Script{strfmt("HOSTFILE='%s' scripts/multi_node/mpirun_hostfile.sh", (dir / "hostfile").c_str()), 16}}) {
        INFO(s.command);
        CommandResult r = run_command(env + s.command);
        INFO("exit status " << r.status << ", output:\n" << r.output);
        CHECK(r.status == 0);
        CHECK(r.output.find("predicted memory per rank") != std::string::npos);
        CHECK(r.output.find(strfmt("layout: %d ranks", s.ranks)) != std::string::npos);
    }
}

TEST_CASE("plot_log.py draws one or more main.log files into a PNG, and names a line it cannot read", "[commands]") {
    TempDir dir;
    Rng rng(17);
    for (const char* run : {"runA", "runB"}) {
        REQUIRE(system(("mkdir -p '" + dir / run + "'").c_str()) == 0);
        std::ofstream log(dir / run + "/main.log");
        float loss = 10.8f;
        for (int step = 0; step < 60; step++) {
            if (step % 20 == 0) {
                log << strfmt("s:%d tel:%.6f\n", step, loss + 0.1f);
                log << strfmt("s:%d eval:%.4f\n", step, 0.25 + 0.002 * step + 0.01 * rng.uniform());
            }
            loss -= 0.05f + 0.02f * rng.uniform();
            // a loss spike whose update was skipped, and an expert load line, which is not drawn
            const char* skipped = step == 33 ? " skipped:1 zloss:6.1" : "";
            log << strfmt("s:%d trl:%.6f lr:%.6e norm:%.6f%s\n", step, step == 33 ? loss + 1.5f : loss, 1e-3,
                          1.0 + rng.uniform(), skipped);
            if (step == 40) log << strfmt("s:%d load:0.21/0.30,0.18/0.33\n", step);
        }
    }
    const std::string png = dir / "both.png";
    CommandResult r = run_command(strfmt("scripts/plot_log.py '%s' '%s' -o '%s'", (dir / "runA/main.log").c_str(),
                                         (dir / "runB/main.log").c_str(), png.c_str()));
    INFO(r.output);
    REQUIRE(r.status == 0);
    CHECK(r.output.find("wrote " + png + " (2 runs)") != std::string::npos);
    std::string image = slurp(png);
    CHECK(image.size() > 10000);
    CHECK(image.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0);

    // without -o the plot goes beside the log
    r = run_command(strfmt("scripts/plot_log.py '%s'", (dir / "runA/main.log").c_str()));
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(file_exists(dir / "runA/loss.png"));

    {
        std::ofstream bad(dir / "bad.log");
        bad << "s:0 trl:10.9 lr:1e-3 norm:1.0\nstep 1 loss 10.2\n";
    }
    r = run_command(strfmt("scripts/plot_log.py '%s' -o '%s'", (dir / "bad.log").c_str(), (dir / "bad.png").c_str()));
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK(r.output.find("bad.log:2: not a main.log line") != std::string::npos);
    CHECK(!file_exists(dir / "bad.png"));
}

TEST_CASE("install_deps.sh without root and without sudo names what is missing in one line", "[commands]") {
    if (geteuid() != 0) {
        WARN("not root: cannot become an unprivileged user to try the no-root path");
        return;
    }
    // nobody has neither root nor sudo; DEPS_EXTRA makes one package missing, as a fresh machine would have
    CommandResult r = run_command(
        "setpriv --reuid=65534 --regid=65534 --clear-groups env -i PATH=/usr/bin:/bin "
        "DEPS_EXTRA='llm5d-absent-package' bash scripts/install_deps.sh");
    INFO("exit status " << r.status << ", output:\n" << r.output);
    CHECK(r.status == 1);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
    CHECK(r.output.find("llm5d-absent-package") != std::string::npos);
    CHECK(r.output.find("apt-get install") != std::string::npos);
}

}  // namespace test_commands
