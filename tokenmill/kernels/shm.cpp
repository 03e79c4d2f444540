// Shared-memory all-reduce for the tensor-parallel ranks of one host (see shm.h).
#include "shm.h"

#include <ATen/ATen.h>

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace tokenmill {

// Layout: the header, then per rank two slots of slot_bytes. Counters sit on their own cache lines.
struct alignas(64) Counter {
  std::atomic<int64_t> value;
  char pad[64 - sizeof(std::atomic<int64_t>)];
};
struct ShmAllReduce::Header {
  alignas(64) std::atomic<int64_t> aborted;
  Counter published[64];  // per rank: the last step whose data is in its slot
  Counter msg_seq;        // the last message rank 0 has written
  Counter msg_len;        // its length in bytes
  Counter msg_ack[64];    // per rank: the last message it has copied out
};
static constexpr int64_t kMaxRanks = 64;

int64_t ShmAllReduce::bytes_needed(int64_t size, int64_t slot_bytes, int64_t msg_bytes) {
  return static_cast<int64_t>(sizeof(Header)) + 2 * size * slot_bytes + msg_bytes;
}

ShmAllReduce::ShmAllReduce(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, int64_t msg_bytes,
                           double timeout_s)
    : rank_(rank), size_(size), slot_bytes_(slot_bytes), msg_bytes_(msg_bytes), timeout_s_(timeout_s) {
  TORCH_CHECK(size >= 1 && size <= kMaxRanks && rank >= 0 && rank < size, "bad rank ", rank, " of ", size);
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0, "slot size must be a positive multiple of 64 bytes");
  const int fd = ::open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "cannot open the tensor-parallel shared memory ", path);
  TORCH_CHECK(msg_bytes >= 0, "bad message area size");
  mapped_ = static_cast<size_t>(bytes_needed(size, slot_bytes, msg_bytes));
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  TORCH_CHECK(p != MAP_FAILED, "cannot map the tensor-parallel shared memory ", path);
  base_ = static_cast<char*>(p);
  header_ = reinterpret_cast<Header*>(base_);
}

ShmAllReduce::~ShmAllReduce() {
  if (base_) ::munmap(base_, mapped_);
}

void ShmAllReduce::abort() { header_->aborted.store(1, std::memory_order_release); }

char* ShmAllReduce::message() const { return base_ + sizeof(Header) + 2 * size_ * slot_bytes_; }

// Spins, then yields; `patient` (a wait for the next message, which may take hours) then naps,
// longer the longer it waits, and never times out. Throws once the group is aborted.
void ShmAllReduce::wait_for(const std::atomic<int64_t>& value, int64_t at_least, bool patient) const {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spins = 0; value.load(std::memory_order_acquire) < at_least; ++spins) {
    if (header_->aborted.load(std::memory_order_relaxed))
      TORCH_CHECK(false, "tensor-parallel group aborted: a rank has stopped");
    if (spins < 20000) {
      _mm_pause();
      continue;
    }
    if ((spins & 255) != 0) {
      sched_yield();
      continue;
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!patient) {
      TORCH_CHECK(waited <= timeout_s_, "tensor-parallel shared memory: a rank did not arrive within ", timeout_s_, " s");
      continue;
    }
    if (waited > 0.01) ::usleep(waited > 1.0 ? 1000 : 100);  // idle: give the core back
  }
}

bool ShmAllReduce::send(at::Tensor bytes) {
  TORCH_CHECK(rank_ == 0, "only rank 0 sends");
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.is_contiguous() && bytes.device().is_cpu(),
              "send takes a contiguous uint8 CPU tensor");
  const int64_t n = bytes.numel();
  if (n > msg_bytes_) return false;
  for (int64_t r = 1; r < size_; ++r) wait_for(header_->msg_ack[r].value, sent_, false);  // the last one read
  std::memcpy(message(), bytes.data_ptr<uint8_t>(), n);
  header_->msg_len.value.store(n, std::memory_order_relaxed);
  header_->msg_seq.value.store(++sent_, std::memory_order_release);
  return true;
}

at::Tensor ShmAllReduce::receive() {
  TORCH_CHECK(rank_ != 0, "rank 0 sends");
  wait_for(header_->msg_seq.value, received_ + 1, true);
  ++received_;
  const int64_t n = header_->msg_len.value.load(std::memory_order_relaxed);
  at::Tensor out = at::empty({n}, at::kByte);
  std::memcpy(out.data_ptr<uint8_t>(), message(), n);
  header_->msg_ack[rank_].value.store(received_, std::memory_order_release);
  return out;
}

template <typename T>
void ShmAllReduce::reduce_all(T* data, int64_t n) {
  const int64_t per = slot_bytes_ / static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < n; off += per) reduce_chunk(data + off, std::min(per, n - off));
}

template <typename T>
void ShmAllReduce::reduce_chunk(T* data, int64_t n) {
  const int64_t step = ++step_;
  auto slot = [&](int64_t r) { return reinterpret_cast<T*>(base_ + sizeof(Header) + (2 * r + step % 2) * slot_bytes_); };
  std::memcpy(slot(rank_), data, n * sizeof(T));
  header_->published[rank_].value.store(step, std::memory_order_release);
  for (int64_t r = 0; r < size_; ++r) wait_for(header_->published[r].value, step, false);
  // every rank sums in rank order: the same bits everywhere
  std::memcpy(data, slot(0), n * sizeof(T));
  for (int64_t r = 1; r < size_; ++r) {
    const T* s = slot(r);
    for (int64_t i = 0; i < n; ++i) data[i] += s[i];
  }
}

void ShmAllReduce::all_reduce_(at::Tensor t) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble) && t.is_contiguous(),
              "shared-memory all-reduce takes a contiguous float32 or float64 CPU tensor");
  if (t.scalar_type() == at::kDouble) return reduce_all(t.data_ptr<double>(), t.numel());
  reduce_all(t.data_ptr<float>(), t.numel());
}

}  // namespace tokenmill
// Registered in stack.cpp, before the decode stack whose methods take it.
