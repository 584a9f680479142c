// A fixed pool of worker threads for the compute kernels. The calling thread takes part as thread 0, so a pool
// of n threads starts n-1 workers. Workers spin briefly between jobs (decode issues hundreds of small jobs per
// token, where sleeping on a condition variable would cost more than the work) and then sleep.
#pragma once

#include <functional>

namespace kvcmas::cpu {

class ThreadPool {
  public:
    // n_threads >= 1. Throws kvcmas::Error otherwise.
    explicit ThreadPool(int n_threads);
    ~ThreadPool();
    ThreadPool(const ThreadPool &)             = delete;
    ThreadPool & operator=(const ThreadPool &) = delete;

    int size() const;

    // Runs fn(ith, nth) once on every thread of the pool, ith in [0, nth), the caller being ith == 0, and returns
    // when all calls have returned. An exception thrown by any call is rethrown here (the first one). Not
    // reentrant: fn must not call run() on the same pool. Callers serialise run() on one pool.
    void run(const std::function<void(int ith, int nth)> & fn);

  private:
    struct Impl;
    Impl * impl_;
};

// Splits [0, n) into nth nearly equal contiguous parts and returns part ith as [begin, end).
inline void split_range(long long n, int ith, int nth, long long & begin, long long & end) {
    const long long per = n / nth, rem = n % nth;
    begin = ith * per + (ith < rem ? ith : rem);
    end   = begin + per + (ith < rem ? 1 : 0);
}

}  // namespace kvcmas::cpu
