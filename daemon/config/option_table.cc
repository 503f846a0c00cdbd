#include "daemon/config/option_table.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace refit::config {
namespace {

using O = DaemonOptions;

std::vector<OptionSpec> MakeTable() {
  std::vector<OptionSpec> t;
  t.push_back({"socket", "PATH", &O::socket_path,
               "Unix socket for local clients; parent directory created; mode 0660",
               "`$REFIT_SOCKET`, else `/run/refit/refitd.sock`"});
  t.push_back({"listen", "HOST:PORT", &O::listen,
               "TCP address for other daemons (port 0 picks one; logged)"});
  t.push_back({"peers", "HOST:PORT,...", &O::peers,
               "the other daemons (in the config file: an array of `\"HOST:PORT\"` or one "
               "comma-separated string)",
               "none"});
  t.push_back({"node",
               "NAME",
               &O::node,
               "this node's name, 1 to 255 bytes (`\"\"` in the config file: the default)",
               "host name",
               0,
               0,
               {},
               false,
               /*empty_keeps_default=*/true});
  t.push_back({"retain", "N", &O::retain, "complete versions kept per model", {}, 1, 1000000});
  t.push_back({"log-level",
               "LEVEL",
               &O::log_level,
               "log verbosity",
               {},
               0,
               0,
               {"trace", "debug", "info", "warn", "error"}});
  t.push_back(
      {"metrics-listen", "HOST:PORT", &O::metrics_listen, "Prometheus text at `/metrics`", "off"});
  t.push_back({"health-listen", "HOST:PORT", &O::health_listen,
               "`grpc.health.v1` alone, for probes", "off"});
  t.push_back({"chunk-bytes",
               "N",
               &O::chunk_bytes,
               "largest single UCX read when pulling from another node",
               {},
               4096,
               double(uint64_t{1} << 30)});
  t.push_back({"inflight", "N", &O::inflight, "UCX reads in flight per pull", {}, 1, 1024});
  t.push_back({"relay-chunk-bytes",
               "N",
               &O::relay_chunk_bytes,
               "largest single UCX read of a stripe this node reads from its origin to relay to "
               "other nodes (at most `--chunk-bytes`): they read each such read from here as it "
               "lands, so a smaller one shortens the wait at a version's start and end (fan-out "
               "over slow links) for a few more reads",
               {},
               64 << 10,
               double(uint64_t{1} << 30)});
  t.push_back({"max-peer-connections",
               "N",
               &O::max_peer_connections,
               "the most control channels this daemon opens to other daemons: `--peers`, plus "
               "relay channels opened on demand to the engines it reads stripes from (learned "
               "from the trainer's replica reports); past it a stripe is read from its origin. "
               "Also the most other nodes served relayed stripes at once (incoming relay "
               "readers); a further reader reads them from the origin",
               {},
               1,
               65536});
  t.push_back({"delta-threshold",
               "F",
               &O::delta_threshold,
               "use a source's deltas only when they are at most this fraction of the bytes a "
               "pull needs; a source drops deltas bigger than this fraction of the buffer; 0 "
               "turns delta sync off",
               {},
               0,
               1});
  t.push_back({"delta-chain",
               "K",
               &O::delta_chain,
               "deltas a source keeps per SOURCE buffer, so a receiver K versions behind still "
               "catches up by deltas",
               {},
               1,
               1000});
  t.push_back({"delta-base", "MODE", &O::delta_base,
               "what an engine's node applies a delta to: `held` (its held copy of the newest "
               "version) or `destination` (its host-memory DESTINATION buffers, which the last "
               "Apply filled: the held copy is released once every destination holds the "
               "version, so the node keeps 1 × the model plus the deltas; see the operator guide "
               "for when this is safe; an `Apply` of a version whose held copy was released "
               "answers `FAILED_PRECONDITION` saying so; `Verify` compares the destinations "
               "with the digests taken of the released copy). "
               "Per model: comma-separated `MODEL=held\\|destination`, a bare mode for the "
               "models not named (`destination,critic=held`). A bad value stops refitd at start "
               "(`INVALID_ARGUMENT: --delta-base=…: 'x' …`). Status: `ModelStatus.delta_base`, "
               "`destination_base_version`, `delta_base_note`"});
  t.push_back({"bucket-export", "DIR", &O::bucket_export,
               "write each version of this node's SOURCE models to DIR (manifest + deltas, a "
               "full base every K)",
               "off"});
  t.push_back({"bucket-import", "DIR", &O::bucket_import,
               "follow DIR (inotify and polling) and complete the versions found there", "off"});
  t.push_back({"bucket-full-every",
               "K",
               &O::bucket_full_every,
               "write a full base to `--bucket-export` every K versions",
               {},
               1,
               1000000});
  t.push_back({"slot-memory",
               "WHERE",
               &O::slot_memory,
               "where version slots live: host memory (pinned when CUDA is compiled in and a GPU "
               "is seen) or GPU memory (a pinned host mirror is kept for other nodes); `cuda` "
               "without the device: refitd refuses to start (exit 1)",
               {},
               0,
               0,
               {"host", "cuda"}});
  t.push_back(
      {"slot-device", "N", &O::slot_device, "the GPU for `--slot-memory=cuda`", {}, 0, 1023});
  t.push_back({"max-slot-memory",
               "SIZE",
               &O::max_slot_memory,
               "most bytes of version slots in host memory (published, pulled, being published "
               "or pulled, kept for reuse), e.g. `64GiB`; spare slots are freed to make room, "
               "then a Publish past it answers `RESOURCE_EXHAUSTED`, and a pull that would pass "
               "it is abandoned with it before it starts (`abandoned_error`, with the bytes); 0 "
               "= no limit",
               {},
               0,
               0,
               {},
               /*size=*/true});
  t.push_back({"max-gpu-slot-memory",
               "SIZE",
               &O::max_gpu_slot_memory,
               "most bytes of version slots in GPU memory (`--slot-memory=cuda`; not counted by "
               "`--max-slot-memory`, which still counts their pinned host mirrors), e.g. "
               "`40GiB`; past it a Publish answers `RESOURCE_EXHAUSTED`; 0 = no limit",
               {},
               0,
               0,
               {},
               /*size=*/true});
  t.push_back({"relay", "BOOL", &O::relay,
               "serve the bytes of versions this node pulled to other nodes pulling the same "
               "version, and read stripes of it from them (fan-out; "
               "[architecture](architecture.md#fleets-relaying-between-engine-nodes)); `false`: "
               "every byte comes from the node that published it, and `Peer.Relay` answers "
               "`FAILED_PRECONDITION`"});
  t.push_back({"site", "NAME", &O::site,
               "this node's site (a data centre, a region), at most 255 bytes: nodes of one site "
               "relay each version among themselves, and each version (full or delta) enters a "
               "site once, its stripes read from the nodes of the origin's site "
               "([architecture](architecture.md#sites-one-crossing-per-version))",
               "none"});
  t.push_back({"allow-uids", "UID,...", &O::allow_uids,
               "local callers (by `SO_PEERCRED`) allowed besides refitd's own uid and root; "
               "everyone else gets `PERMISSION_DENIED` on every RPC, health included "
               "([security](security.md))",
               "none", 0, 4294967294.0});
  t.push_back({"allow-gids", "GID,...", &O::allow_gids,
               "local callers allowed by group (the caller's primary and supplementary groups)",
               "the socket's group", 0, 4294967294.0});
  t.push_back({"max-waiting-calls",
               "N",
               &O::max_waiting_calls,
               "long-lived calls local callers may hold open at once in all (`Watch`, "
               "`WaitForVersion`, `WaitForReplicas`, `grpc.health.v1` `Watch`: each holds a "
               "server thread); past it such a call answers `RESOURCE_EXHAUSTED` at once "
               "([security](security.md))",
               {},
               1,
               1000000});
  t.push_back({"max-waiting-calls-per-uid",
               "N",
               &O::max_waiting_calls_per_uid,
               "the same per uid (all its processes together); a uid's shared server (processes "
               "refitd cannot see) has this many threads plus 32",
               {},
               1,
               100000});
  t.push_back({"max-waiting-calls-per-process",
               "N",
               &O::max_waiting_calls_per_process,
               "the same per client process; its own server has this many threads plus 8",
               {},
               1,
               100000});
  t.push_back({"max-local-threads",
               "N",
               &O::max_local_threads,
               "while refitd runs this many threads, a new local client process gets no server "
               "of its own: it shares its uid's server (and its buffers are not released when "
               "it exits)",
               {},
               64,
               1000000});
  t.push_back({"max-unspoken-connections-per-uid",
               "N",
               &O::max_unspoken_connections_per_uid,
               "local connections of one uid that have not completed their first message yet "
               "(the HTTP/2 preface, or `REFITFD1` with its fd); past it that uid's new "
               "connections are closed at once; each waits at most 5 s",
               {},
               1,
               100000});
  t.push_back({"tls-cert", "PEM", &O::tls_cert,
               "this node's certificate: mutual TLS on the peer port and every daemon-to-daemon "
               "channel; a peer's node name must be its certificate's CN or DNS name; files "
               "reread every minute; `--tls-cert`, `--tls-key`, `--tls-ca`: all three or none "
               "(exit 1)",
               "`$CREDENTIALS_DIRECTORY/tls.crt`, `tls.key`, `ca.crt` when systemd passes them "
               "(the unit's `LoadCredential=` from `/etc/refit/tls/`), else none: plaintext, "
               "refused on a non-loopback `--listen` without `--allow-plaintext-peers`"});
  t.push_back({"tls-key", "PEM", &O::tls_key, "the private key of `--tls-cert`", "none"});
  t.push_back(
      {"tls-ca", "PEM", &O::tls_ca, "the CA every peer's certificate must chain to", "none"});
  t.push_back({"allow-plaintext-peers", "BOOL", &O::allow_plaintext_peers,
               "start without `--tls-*` although `--listen` is not a loopback address (the peer "
               "plane is then open to any host that reaches the port: it can claim a node name "
               "and read every weight). Without it such a start is refused (exit 1) naming the "
               "fix: give `--tls-cert`, `--tls-key`, `--tls-ca`, or listen on `127.0.0.1`. A "
               "bare `--allow-plaintext-peers` means `true`"});
  t.push_back({"state-dir", "DIR", &O::state_dir,
               "where refitd keeps what outlives a restart: each model's newest published "
               "version (`DIR/state.json`)",
               "`$STATE_DIRECTORY` (systemd's `StateDirectory=`; the first if several), else "
               "none"});
  t.push_back({"data-ports", "LOW-HIGH", &O::data_ports,
               "the TCP ports UCX's tcp data plane listens on (`UCX_TCP_PORT_RANGE`); UCX "
               "listens on `--listen`'s interface (`UCX_NET_DEVICES`, RDMA devices kept), on "
               "every interface only when `--listen`'s host is `0.0.0.0` / `::`; "
               "`UCX_NET_DEVICES` / `UCX_TCP_PORT_RANGE` in the environment win. A `--listen` "
               "host no interface has stops the start",
               "any port"});
  return t;
}

std::string Number(double v) {
  if (v == std::floor(v) && std::fabs(v) < 1e18) return std::to_string(static_cast<int64_t>(v));
  return absl::StrCat(v);
}

bool InRange(const OptionSpec& spec, double v) {
  return (spec.min == 0 && spec.max == 0) || (v >= spec.min && v <= spec.max);
}

absl::Status Bad(const OptionSpec& spec) { return absl::InvalidArgumentError(Expectation(spec)); }

// An integer in the spec's range (sizes too), as uint64 (int fields are checked >= 0 by range).
absl::Status ParseInteger(const OptionSpec& spec, const std::string& text, uint64_t* out) {
  bool ok =
      spec.size ? ParseSize(text, out) : absl::SimpleAtoi(absl::StripAsciiWhitespace(text), out);
  if (!ok || !InRange(spec, static_cast<double>(*out))) return Bad(spec);
  return absl::OkStatus();
}

bool ParseBool(const std::string& text, bool* out) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (t == "true" || t == "1" || t == "yes" || t == "on") return *out = true, true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return *out = false, true;
  return false;
}

}  // namespace

std::string OptionSpec::Key() const { return absl::StrReplaceAll(std::string(flag), {{"-", "_"}}); }

const std::vector<OptionSpec>& OptionTable() {
  static const std::vector<OptionSpec>* table = new std::vector<OptionSpec>(MakeTable());
  return *table;
}

const OptionSpec* FindByKey(const std::string& key) {
  for (const OptionSpec& spec : OptionTable()) {
    if (spec.Key() == key) return &spec;
  }
  return nullptr;
}

std::string Expectation(const OptionSpec& spec) {
  const std::string range = absl::StrCat(Number(spec.min), " to ", Number(spec.max));
  const bool ranged = spec.min != 0 || spec.max != 0;
  return std::visit(
      [&](auto field) -> std::string {
        using T = std::remove_reference_t<decltype(std::declval<O>().*field)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (spec.choices.empty()) return "must be a string";
          return absl::StrCat("must be one of ", absl::StrJoin(spec.choices, ", "));
        } else if constexpr (std::is_same_v<T, bool>) {
          return "must be true or false";
        } else if constexpr (std::is_same_v<T, double>) {
          return ranged ? absl::StrCat("must be a number from ", range) : "must be a number";
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return "must be a list of \"HOST:PORT\" strings";
        } else if constexpr (std::is_same_v<T, std::vector<uint32_t>>) {
          return "must be a list of integer ids";
        } else if (spec.size) {
          return "must be a size: bytes, or a number with K, M, G or T (e.g. 64GiB); 0: no limit";
        } else {
          return ranged ? absl::StrCat("must be an integer from ", range) : "must be an integer";
        }
      },
      spec.field);
}

absl::Status SetFromText(const OptionSpec& spec, const std::string& text, DaemonOptions* options) {
  return std::visit(
      [&](auto field) -> absl::Status {
        auto& value = options->*field;
        using T = std::remove_reference_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!spec.choices.empty() &&
              std::find(spec.choices.begin(), spec.choices.end(), text) == spec.choices.end()) {
            return Bad(spec);
          }
          value = std::string(text);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!ParseBool(text, &value)) return Bad(spec);
        } else if constexpr (std::is_same_v<T, double>) {
          double v;
          if (!absl::SimpleAtod(absl::StripAsciiWhitespace(text), &v) || !std::isfinite(v) ||
              !InRange(spec, v)) {
            return Bad(spec);
          }
          value = v;
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          value.clear();
          for (absl::string_view p : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
            value.emplace_back(std::string(absl::StripAsciiWhitespace(p)));
          }
        } else if constexpr (std::is_same_v<T, std::vector<uint32_t>>) {
          value.clear();
          for (absl::string_view p : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
            uint64_t id;
            if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(p), &id) || !InRange(spec, id)) {
              return Bad(spec);
            }
            value.push_back(static_cast<uint32_t>(id));
          }
        } else {
          uint64_t v;
          if (auto status = ParseInteger(spec, text, &v); !status.ok()) return status;
          if (v > std::numeric_limits<T>::max()) return Bad(spec);
          value = static_cast<T>(v);
        }
        return absl::OkStatus();
      },
      spec.field);
}

std::string DefaultText(const OptionSpec& spec) {
  if (spec.default_text != nullptr && *spec.default_text != '\0') return spec.default_text;
  static const DaemonOptions defaults;
  return std::visit(
      [&](auto field) -> std::string {
        const auto& value = defaults.*field;
        using T = std::remove_cv_t<std::remove_reference_t<decltype(value)>>;
        if constexpr (std::is_same_v<T, std::string>) {
          return value.empty() ? "none" : absl::StrCat("`", value, "`");
        } else if constexpr (std::is_same_v<T, bool>) {
          return value ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          return Number(value);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>> ||
                             std::is_same_v<T, std::vector<uint32_t>>) {
          return value.empty() ? "none" : absl::StrJoin(value, ",");
        } else {
          return std::to_string(value);
        }
      },
      spec.field);
}

bool ParseSize(const std::string& full_text, uint64_t* bytes) {
  absl::string_view text = absl::StripAsciiWhitespace(full_text);
  size_t digits = 0;
  while (digits < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    ++digits;
  }
  double number;
  if (digits == 0 || !absl::SimpleAtod(text.substr(0, digits), &number)) return false;
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(digits)));
  if (unit.size() > 1 && unit.back() == 'b') unit.pop_back();  // "gb", "gib"
  if (unit.size() > 1 && unit.back() == 'i') unit.pop_back();  // "gi"
  double scale;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k") {
    scale = 1024.0;
  } else if (unit == "m") {
    scale = 1024.0 * 1024;
  } else if (unit == "g") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "t") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    return false;
  }
  const double value = number * scale;
  if (!(value >= 0) || value >= 18446744073709551615.0 || value != std::floor(value)) {
    return false;
  }
  *bytes = static_cast<uint64_t>(value);
  return true;
}

std::string Describe(const OptionSpec& spec) {
  if (!spec.choices.empty()) {
    return absl::StrCat(spec.help, " (one of ", absl::StrJoin(spec.choices, ", "), ")");
  }
  if ((spec.min != 0 || spec.max != 0) &&
      !std::holds_alternative<std::vector<uint32_t> O::*>(spec.field)) {
    return absl::StrCat(spec.help, " (", Number(spec.min), " to ", Number(spec.max), ")");
  }
  return spec.help;
}

std::string RenderMarkdown() {
  std::string out = "| flag | meaning | default |\n|---|---|---|\n";
  for (const OptionSpec& spec : OptionTable()) {
    absl::StrAppend(&out, "| `--", spec.flag, "=",
                    absl::StrReplaceAll(std::string(spec.value_name), {{"|", "\\|"}}), "` | ",
                    Describe(spec), " | ", DefaultText(spec), " |\n");
  }
  absl::StrAppend(&out,
                  "| `--config=FILE` | TOML file with the keys below; flags override it; unknown "
                  "keys and bad values stop the start (exit 2) naming the key | none |\n",
                  "| `--version` | print the version and whether CUDA is compiled in | |\n\n");
  std::vector<std::string> keys;
  for (const OptionSpec& spec : OptionTable()) keys.push_back(absl::StrCat("`", spec.Key(), "`"));
  absl::StrAppend(&out,
                  "Config file keys (`--config`, TOML; a documented sample is "
                  "`deploy/refitd.toml`) are the flag names with `-` written as `_`: ",
                  absl::StrJoin(keys, ", "),
                  ". Values have the flag's type: strings, integers, numbers, `true`/`false`; "
                  "sizes as bytes or a string such as `\"64GiB\"`; id lists and `peers` as "
                  "arrays.\n");
  return out;
}

}  // namespace refit::config
