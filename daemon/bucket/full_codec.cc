#include "daemon/bucket/full_codec.h"

#include <zstd.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/bucket/file_io.h"
#include "daemon/bucket/format.h"
#include "daemon/common/xxh3.h"

namespace refit::bucket::internal {
namespace {

constexpr size_t kInputSlice = size_t{1} << 20;  // hashed, then compressed, while in cache
constexpr size_t kFileBlock = size_t{4} << 20;   // bytes per write / read call
constexpr int kMaxWindowLog = 27;                // decoder memory bound: 128 MiB window
constexpr size_t kMaxFrameHeader = 18;           // ZSTD_FRAMEHEADERSIZE_MAX (static API)

struct CCtxFree {
  void operator()(ZSTD_CCtx* c) const { ZSTD_freeCCtx(c); }
};
struct DCtxFree {
  void operator()(ZSTD_DCtx* d) const { ZSTD_freeDCtx(d); }
};
struct StateFree {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using HashState = std::unique_ptr<XXH3_state_t, StateFree>;

HashState NewHash() {
  HashState state(XXH3_createState());
  if (state) XXH3_64bits_reset(state.get());
  return state;
}

absl::Status ZstdError(size_t code, const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", ZSTD_getErrorName(code)));
}

}  // namespace

absl::StatusOr<CompressResult> CompressToFd(int fd, const std::string& path, const uint8_t* data,
                                            uint64_t bytes, int level, int workers) {
  std::unique_ptr<ZSTD_CCtx, CCtxFree> cctx(ZSTD_createCCtx());
  HashState file_hash = NewHash(), data_hash = NewHash();
  if (!cctx || !file_hash || !data_hash) return absl::ResourceExhaustedError("zstd/xxh3 state");
  size_t rc = ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level);
  if (ZSTD_isError(rc)) return ZstdError(rc, "zstd level");
  if (workers > 0) {
    // A libzstd built without threads refuses; compress on this thread then.
    ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_nbWorkers, workers);
  }
  rc = ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_contentSizeFlag, 1);
  if (ZSTD_isError(rc)) return ZstdError(rc, "zstd content size flag");
  rc = ZSTD_CCtx_setPledgedSrcSize(cctx.get(), bytes);
  if (ZSTD_isError(rc)) return ZstdError(rc, "zstd pledged size");

  CompressResult result;
  std::vector<uint8_t> out_buffer(kFileBlock);
  uint64_t done = 0;
  bool finished = false;
  while (!finished) {
    const size_t slice = static_cast<size_t>(std::min<uint64_t>(kInputSlice, bytes - done));
    const bool last = done + slice == bytes;
    XXH3_64bits_update(data_hash.get(), data + done, slice);
    ZSTD_inBuffer in{data + done, slice, 0};
    for (;;) {
      ZSTD_outBuffer out{out_buffer.data(), out_buffer.size(), 0};
      const size_t remaining =
          ZSTD_compressStream2(cctx.get(), &out, &in, last ? ZSTD_e_end : ZSTD_e_continue);
      if (ZSTD_isError(remaining)) return ZstdError(remaining, "zstd compress " + path);
      if (out.pos > 0) {
        absl::Status written = WriteAll(fd, out_buffer.data(), out.pos, path);
        if (!written.ok()) return written;
        XXH3_64bits_update(file_hash.get(), out_buffer.data(), out.pos);
        result.file_bytes += out.pos;
      }
      if (last ? remaining == 0 : in.pos == in.size) break;
    }
    done += slice;
    finished = last;
  }
  result.file_xxh3 = XXH3_64bits_digest(file_hash.get());
  result.data_xxh3 = XXH3_64bits_digest(data_hash.get());
  return result;
}

absl::Status DecompressFromFd(int fd, const std::string& path, uint64_t file_bytes,
                              uint64_t file_xxh3, uint8_t* out, uint64_t bytes) {
  auto size = FileSize(fd, path);
  if (!size.ok()) return size.status();
  if (*size != file_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", *size, " bytes, the manifest says ",
                                            file_bytes, *size < file_bytes ? " (truncated)" : ""));
  }
  uint8_t header[kMaxFrameHeader];
  const size_t header_bytes = static_cast<size_t>(std::min<uint64_t>(sizeof(header), file_bytes));
  absl::Status read = PreadExactly(fd, header, header_bytes, 0, path);
  if (!read.ok()) return read;
  const unsigned long long content = ZSTD_getFrameContentSize(header, header_bytes);
  if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN) {
    return absl::DataLossError(absl::StrCat(path, ": not a zstd frame with a content size"));
  }
  if (content != bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": frame holds ", content, " bytes, the manifest says ", bytes));
  }

  std::unique_ptr<ZSTD_DCtx, DCtxFree> dctx(ZSTD_createDCtx());
  HashState file_hash = NewHash();
  if (!dctx || !file_hash) return absl::ResourceExhaustedError("zstd/xxh3 state");
  ZSTD_DCtx_setParameter(dctx.get(), ZSTD_d_windowLogMax, kMaxWindowLog);
  std::vector<uint8_t> in_buffer(kFileBlock);
  ZSTD_outBuffer output{out, bytes, 0};
  uint64_t offset = 0;
  size_t pending = 1;  // ZSTD_decompressStream's answer: 0 once the frame is complete
  while (offset < file_bytes) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(kFileBlock, file_bytes - offset));
    read = PreadExactly(fd, in_buffer.data(), chunk, offset, path);
    if (!read.ok()) return read;
    XXH3_64bits_update(file_hash.get(), in_buffer.data(), chunk);
    offset += chunk;
    ZSTD_inBuffer input{in_buffer.data(), chunk, 0};
    while (input.pos < input.size) {
      if (pending == 0) {
        return absl::DataLossError(absl::StrCat(path, ": bytes after the end of the frame"));
      }
      const size_t in_before = input.pos, out_before = output.pos;
      pending = ZSTD_decompressStream(dctx.get(), &output, &input);
      if (ZSTD_isError(pending)) {
        return absl::DataLossError(
            absl::StrCat(path, ": corrupt zstd frame (", ZSTD_getErrorName(pending), ")"));
      }
      if (pending != 0 && input.pos == in_before && output.pos == out_before) {
        return absl::DataLossError(absl::StrCat(path, ": frame holds more than ", bytes, " bytes"));
      }
    }
  }
  // Whatever the decoder still holds goes out without more input (it has all the room).
  for (int i = 0; i < 4 && pending != 0 && output.pos < bytes; ++i) {
    ZSTD_inBuffer none{nullptr, 0, 0};
    const size_t out_before = output.pos;
    pending = ZSTD_decompressStream(dctx.get(), &output, &none);
    if (ZSTD_isError(pending)) {
      return absl::DataLossError(
          absl::StrCat(path, ": corrupt zstd frame (", ZSTD_getErrorName(pending), ")"));
    }
    if (output.pos == out_before) break;
  }
  if (XXH3_64bits_digest(file_hash.get()) != file_xxh3) {
    return absl::DataLossError(absl::StrCat(path, ": file checksum mismatch"));
  }
  if (pending != 0 || output.pos != bytes) {
    return absl::DataLossError(
        absl::StrCat(path, ": frame ends early (", output.pos, " of ", bytes, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace refit::bucket::internal
