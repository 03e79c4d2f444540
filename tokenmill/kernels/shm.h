// All-reduce between the tensor-parallel ranks of one host through shared memory.
//
// Gloo over loopback TCP takes milliseconds per all-reduce of a few kilobytes, many loopback round
// trips, and a decoder layer needs two: at 30 layers that alone dwarfs a token's arithmetic
// (benchmarks/tp_bench.py). Ranks on one host instead meet in a shared mapping: each copies its partial sums into its
// slot and publishes a step counter; once every rank's counter has reached the step, each rank sums
// all slots in rank order into its tensor, so every rank ends with the same bits. Two slots per
// rank alternate between steps: a rank reaching step n+2 has seen every counter at n+1, so every
// rank has finished reading step n and the slot is free again.
//
// The same mapping carries each step's message from rank 0 to the others (`send` / `receive`):
// a byte area, its length and a sequence number, and per rank an acknowledgement, so rank 0 never
// overwrites a message a rank has not yet copied out. A rank waiting for a message may wait for
// hours (an idle server): it spins briefly, then yields, then sleeps in growing naps up to 1 ms.
//
// Waiting spins (ranks on their own cores answer in microseconds), then yields the core. A flag
// in the mapping aborts every wait: rank 0 sets it when a worker dies, and a wait that sees it, or
// that outlasts the timeout, throws instead of hanging.
#pragma once

#include <torch/custom_class.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace tokenmill {

class ShmAllReduce : public torch::CustomClassHolder {
 public:
  // `path`: a file under /dev/shm that rank 0 created with `bytes_needed(size, slot_bytes)` bytes.
  ShmAllReduce(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, int64_t msg_bytes,
               double timeout_s);
  ~ShmAllReduce() override;
  static int64_t bytes_needed(int64_t size, int64_t slot_bytes, int64_t msg_bytes);

  // Sums a contiguous float32 or float64 CPU tensor over the ranks, in place.
  void all_reduce_(at::Tensor t);
  // Rank 0: hands `bytes` (uint8) to every other rank; false (nothing sent) if it exceeds msg_bytes.
  bool send(at::Tensor bytes);
  // Other ranks: the next message from rank 0 (waits as long as it takes, or until abort).
  at::Tensor receive();
  // Makes every rank's current and future waits throw (a rank died).
  void abort();

 private:
  struct Header;
  template <typename T>
  void reduce_all(T* data, int64_t n);
  template <typename T>
  void reduce_chunk(T* data, int64_t n);
  Header* header_ = nullptr;
  char* base_ = nullptr;
  size_t mapped_ = 0;
  char* message() const;
  void wait_for(const std::atomic<int64_t>& value, int64_t at_least, bool patient) const;
  int64_t rank_, size_, slot_bytes_, msg_bytes_;
  int64_t sent_ = 0, received_ = 0;
  double timeout_s_;
  int64_t step_ = 0;
};

}  // namespace tokenmill
