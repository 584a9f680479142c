#include "backend/cpu/threadpool.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/error.h"

#if defined(KC_X86)
#    include <immintrin.h>
#endif

namespace kvcmas::cpu {
namespace {

inline void cpu_relax() {
#if defined(KC_X86)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

// How long an idle worker polls for the next job before sleeping: long enough to bridge the gaps between the
// kernels of one decode step, short enough not to burn a core while the engine is idle.
constexpr auto kSpinTime = std::chrono::microseconds(300);

}  // namespace

struct ThreadPool::Impl {
    int                      n_threads = 1;
    std::vector<std::thread> workers;

    // The job of the current generation; published before `generation` is bumped (release), read after it is seen.
    const std::function<void(int, int)> * job = nullptr;
    std::atomic<uint64_t>                 generation{ 0 };
    std::atomic<int>                      remaining{ 0 };  // parts 1..n-1 of the current job not yet finished
    // slot_taken[i] != 0 once someone (worker i, or the caller standing in for it) has taken part i of the job.
    std::unique_ptr<std::atomic<int>[]> slot_taken;
    std::atomic<bool>                     stop{ false };  // set (under mu) before the final generation bump

    std::mutex              mu;  // guards sleeping (with cv) and stop
    std::condition_variable cv;

    std::mutex         error_mu;
    std::exception_ptr error;

    void record_error(std::exception_ptr e) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) {
            error = std::move(e);
        }
    }

    // Runs part ith of the current job unless it was already taken; returns whether it ran it.
    bool run_part(int ith) {
        if (slot_taken[ith].exchange(1, std::memory_order_acq_rel) != 0) {
            return false;
        }
        try {
            (*job)(ith, n_threads);
        } catch (...) {
            record_error(std::current_exception());
        }
        remaining.fetch_sub(1, std::memory_order_acq_rel);
        return true;
    }

    void worker_main(int ith) {
        uint64_t seen = 0;
        for (;;) {
            uint64_t g     = generation.load(std::memory_order_acquire);
            auto     start = std::chrono::steady_clock::now();
            for (unsigned spins = 0; g == seen; ++spins) {
                cpu_relax();
                g = generation.load(std::memory_order_acquire);
                if ((spins & 255) == 255 && std::chrono::steady_clock::now() - start > kSpinTime) {
                    break;
                }
            }
            if (g == seen) {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return generation.load(std::memory_order_acquire) != seen; });
                g = generation.load(std::memory_order_acquire);
            }
            seen = g;
            if (stop.load(std::memory_order_acquire)) {
                return;
            }
            run_part(ith);
        }
    }
};

ThreadPool::ThreadPool(int n_threads) {
    KC_CHECK(n_threads >= 1 && n_threads <= 1024, "ThreadPool: n_threads must be in [1, 1024], got %d", n_threads);
    impl_            = new Impl;
    impl_->n_threads = n_threads;
    impl_->slot_taken.reset(new std::atomic<int>[n_threads]);
    for (int i = 0; i < n_threads; ++i) {
        impl_->slot_taken[i].store(1);
    }
    try {
        for (int i = 1; i < n_threads; ++i) {
            impl_->workers.emplace_back([this, i] { impl_->worker_main(i); });
        }
    } catch (...) {
        this->~ThreadPool();
        throw;
    }
}

ThreadPool::~ThreadPool() {
    if (impl_ == nullptr) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(impl_->mu);
        impl_->stop.store(true, std::memory_order_release);
        impl_->generation.fetch_add(1, std::memory_order_release);
    }
    impl_->cv.notify_all();
    for (std::thread & t : impl_->workers) {
        t.join();
    }
    delete impl_;
    impl_ = nullptr;
}

int ThreadPool::size() const { return impl_->n_threads; }

void ThreadPool::run(const std::function<void(int ith, int nth)> & fn) {
    Impl & p = *impl_;
    if (p.n_threads == 1) {
        fn(0, 1);
        return;
    }
    p.error = nullptr;
    p.job   = &fn;
    p.remaining.store(p.n_threads - 1, std::memory_order_relaxed);
    for (int i = 1; i < p.n_threads; ++i) {
        p.slot_taken[i].store(0, std::memory_order_release);
    }
    {
        // Under the mutex so that a worker deciding to sleep cannot miss the bump.
        std::lock_guard<std::mutex> lock(p.mu);
        p.generation.fetch_add(1, std::memory_order_release);
    }
    p.cv.notify_all();

    try {
        fn(0, p.n_threads);
    } catch (...) {
        p.record_error(std::current_exception());
    }
    // A worker that has not picked up its part by now is asleep or descheduled (busy machine): do its part here
    // rather than wait for the scheduler. Parts already taken are waited for.
    for (int i = 1; i < p.n_threads; ++i) {
        p.run_part(i);
    }
    for (unsigned spins = 0; p.remaining.load(std::memory_order_acquire) != 0; ++spins) {
        if (spins < 4096) {
            cpu_relax();
        } else {
            std::this_thread::yield();
        }
    }
    p.job = nullptr;
    if (p.error) {
        std::exception_ptr e = p.error;
        p.error              = nullptr;
        std::rethrow_exception(e);
    }
}

}  // namespace kvcmas::cpu
