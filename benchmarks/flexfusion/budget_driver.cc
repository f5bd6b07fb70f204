// Runs the paper authors' fused-schedule solver, FlexFusion's DualEgoSolver.h
// (github.com/FlexFusion/FlexFusion, commit 212c257, compiled unchanged from a checkout of it), under a
// wall-clock budget on a given number of threads; its own MPI driver has no time budget. Half the time:
// its makespan annealing from its greedy start, one seed per thread (skipped where its own
// configuration for the instance has none); the rest: its memory annealing from the best of those, one
// seed per thread. Each run's cooling rate is set so that its annealing ends when its time is up, from
// a short timed run of that same annealing. Built and run by benchmarks/flexfusion_compare.py.
// Usage: budget_driver pp0 pp1 m0 m1 fwd0 fwd1 mem0 mem1 e2e_t0 e2e_t1 mem_t0 mem_t1 seconds threads
// Prints: greedy T P phase1 T P final T P steps S1 S2 wall W (T: makespan, P: peak memory).
#include "DualEgoSolver.h"
#include <chrono>
#include <cmath>
#include <thread>
using ds = DualEgoSolver;
using clk = std::chrono::steady_clock;

static vector<ds::ModelMeta> metas(int pp0, int pp1, int m0, int m1, int f0, int f1, float a0, float a1) {
	vector<ds::ModelMeta> out;
	vector<int> r0;
	for (int i = 0; i < pp0; ++i) r0.push_back(i);
	out.push_back({m0, f0, 2 * f0, r0, a0, "", ""});
	for (int k = 0; k < pp0 / pp1; ++k) {  // pp0/pp1 copies of the smaller model, reversed
		vector<int> r1;
		for (int i = (k + 1) * pp1 - 1; i >= k * pp1; --i) r1.push_back(i);
		out.push_back({m1, f1, 2 * f1, r1, a1, "", ""});
	}
	return out;
}

static double secs(clk::time_point a) { return std::chrono::duration<double>(clk::now() - a).count(); }

// anneal every seed (one thread each) for `budget` seconds; returns the best schedule and the steps per seed
static pair<ds::TaskSched, long> phase(int pp0, const vector<ds::ModelMeta> &mm, const ds::TaskSched &from, bool e2e,
                                       double t0, double t1, double budget, int threads) {
	auto run = [&](int seed, double rate) {
		ds solver(pp0, mm);
		ds::SimAnnealConfig cfg{t0, rate, t1, seed, e2e ? ds::sim_anneal_disturb_t::RANDOM_ADJACENT_SWAP
		                                               : ds::sim_anneal_disturb_t::RANDOM_MOVE};
		return e2e ? solver.optimize_e2e_time(cfg, from) : solver.optimize_peak_memory(cfg, from);
	};
	const long probe = 20000;  // steps of the timing run
	auto start = clk::now();
	run(1000, std::exp(std::log(t1 / t0) / probe));
	double per_step = secs(start) / probe;
	long steps = std::max(1L, (long)((budget - secs(start)) / per_step));
	double rate = std::exp(std::log(t1 / t0) / steps);
	vector<ds::TaskSched> out(threads);
	vector<std::thread> pool;
	for (int s = 0; s < threads; ++s) pool.emplace_back([&, s] { out[s] = run(s, rate); });
	for (auto &t : pool) t.join();
	ds solver(pp0, mm);
	ds::TaskSched best = from;
	for (auto &s : out)
		if (ds::is_trace_more_optimal(solver.task_sched2trace(s), solver.task_sched2trace(best))) best = s;
	return {best, steps};
}

int main(int argc, char **argv) {
	if (argc != 15) { fprintf(stderr, "usage: see the header\n"); return 2; }
	int pp0 = atoi(argv[1]), pp1 = atoi(argv[2]), m0 = atoi(argv[3]), m1 = atoi(argv[4]);
	int f0 = atoi(argv[5]), f1 = atoi(argv[6]);
	float a0 = atof(argv[7]), a1 = atof(argv[8]);
	double e0 = atof(argv[9]), e1 = atof(argv[10]), q0 = atof(argv[11]), q1 = atof(argv[12]), budget = atof(argv[13]);
	int threads = atoi(argv[14]);
	auto mm = metas(pp0, pp1, m0, m1, f0, f1, a0, a1);
	auto begin = clk::now();
	ds solver(pp0, mm);
	ds::TaskSched sched = solver.get_init_task_sched(ds::sim_anneal_init_t::GREEDY);
	auto g = solver.task_sched2trace(sched);
	long steps1 = 0, steps2 = 0;
	if (e0 > 0) {
		auto r = phase(pp0, mm, sched, true, e0, e1, budget / 2 - secs(begin), threads);
		sched = r.first; steps1 = r.second;
	}
	auto p1 = solver.task_sched2trace(sched);
	auto r = phase(pp0, mm, sched, false, q0, q1, budget - secs(begin), threads);
	auto fin = solver.task_sched2trace(r.first);
	steps2 = r.second;
	printf("greedy %d %.4f phase1 %d %.4f final %d %.4f steps %ld %ld wall %.1f\n", g.time_usage, g.peak_memory_usage,
	       p1.time_usage, p1.peak_memory_usage, fin.time_usage, fin.peak_memory_usage, steps1, steps2, secs(begin));
	return 0;
}
