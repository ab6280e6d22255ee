// The per-layer scheduling problem as a MILP for GLPK (glpk.h): columns, rows and the solution read back.
#include "offload/schedule-ilp.h"

#include "core/error.h"

#include <fmt/format.h>
#include <glpk.h>

#include <algorithm>
#include <cmath>
#include <memory>

namespace prescope {

namespace {

/// A GLPK problem built row by row; columns and rows are 1-based as GLPK numbers them.
class Milp {
  public:
    Milp() : lp_(glp_create_prob()) { glp_set_obj_dir(lp_, GLP_MIN); }
    ~Milp() { glp_delete_prob(lp_); }
    Milp(const Milp &) = delete;
    Milp &operator=(const Milp &) = delete;

    int binary(double objective = 0) {
        const int c = glp_add_cols(lp_, 1);
        glp_set_col_kind(lp_, c, GLP_BV);
        glp_set_obj_coef(lp_, c, objective);
        ++binaries_;
        return c;
    }
    int fixed_binary(double value) {
        const int c = binary();
        glp_set_col_bnds(lp_, c, GLP_FX, value, value);
        return c;
    }
    int time(double objective = 0) {
        const int c = glp_add_cols(lp_, 1);
        glp_set_col_kind(lp_, c, GLP_CV);
        glp_set_col_bnds(lp_, c, GLP_LO, 0.0, 0.0);
        glp_set_obj_coef(lp_, c, objective);
        return c;
    }

    /// A row under construction: sum of coef x column, then >= / <= / == a constant.
    struct Row {
        std::vector<int> ind{0};
        std::vector<double> val{0.0};
        Row &add(int col, double coef) {
            if (coef == 0) return *this;
            for (size_t i = 1; i < ind.size(); ++i) {
                if (ind[i] == col) {
                    val[i] += coef;
                    return *this;
                }
            }
            ind.push_back(col);
            val.push_back(coef);
            return *this;
        }
    };
    void at_least(const Row &r, double rhs) { put(r, GLP_LO, rhs, 0.0); }
    void at_most(const Row &r, double rhs) { put(r, GLP_UP, 0.0, rhs); }
    void equal(const Row &r, double rhs) { put(r, GLP_FX, rhs, rhs); }

    glp_prob *lp() { return lp_; }
    int binaries() const { return binaries_; }
    int rows() const { return glp_get_num_rows(lp_); }

  private:
    void put(const Row &r, int type, double lo, double hi) {
        const int i = glp_add_rows(lp_, 1);
        glp_set_row_bnds(lp_, i, type, lo, hi);
        glp_set_mat_row(lp_, i, int(r.ind.size()) - 1, r.ind.data(), r.val.data());
    }
    glp_prob *lp_;
    int binaries_ = 0;
};

} // namespace

IlpResult solve_layer_ilp(const LayerState &s, const IlpOptions &o) {
    IlpResult res;
    const size_t n = s.routed.size();
    const bool stream = s.stream && s.wave_slots > 0;

    // Constants of the layer: the hits, the experts that can only run on the CPU.
    bool any_hit = false;
    double hit_arrival = 0, hit_gpu = 0, cpu_fixed = 0, big = 1000;
    int32_t cpu_only = 0;
    std::vector<int32_t> misses;  // routed indices of the missed experts that may run on the GPU, ascending id
    // big bounds every time of the layer (all work serialised); kept tight: GLPK's integrality tolerance times
    // big is the slack a big-M row can leak.
    for (size_t i = 0; i < n; ++i) {
        const SchedExpert &x = s.routed[i];
        const bool hit_only = x.where != SchedResidency::MISSING && x.site != ExecSite::CPU;
        big += (hit_only ? 0.0 : x.cpu_us + x.fetch_us) + x.gpu_us + s.wave_us + x.arrival_us;
        if (x.site == ExecSite::CPU) {
            ++cpu_only;
            cpu_fixed += x.cpu_us;
        } else if (x.where != SchedResidency::MISSING) {
            any_hit = true;
            hit_gpu += x.gpu_us;
            if (x.where == SchedResidency::ARRIVING) hit_arrival = std::max(hit_arrival, x.arrival_us);
        } else if (x.site == ExecSite::GPU || s.wave_slots > 0) {
            misses.push_back(int32_t(i));
        } else {
            ++cpu_only;  // no GPU cache: the CPU is the only way
            cpu_fixed += x.cpu_us;
        }
    }
    big += s.link_free_us + s.host_us + s.cpu_layer_us + s.prefetch_backlog_us + s.issue_slack_us + 4 * s.wave_us;
    for (const SchedCandidate &c : s.candidates) big += c.fetch_us + prefetch_deadline_us(s, c.distance);
    const auto m = int32_t(misses.size());
    const double big_n = double(m + 1);
    const int32_t free = std::max(s.free_slots, 0), per_wave = std::max(s.wave_slots, 1);
    const int32_t n_waves = stream ? (std::max(m - free, 0) + per_wave - 1) / per_wave : 0;

    Milp p;
    using Row = Milp::Row;
    std::vector<int> x(static_cast<size_t>(m)), u(static_cast<size_t>(m) * static_cast<size_t>(n_waves + 1), 0);
    auto uw = [&](int32_t i, int32_t w) -> int & { return u[size_t(i) * size_t(n_waves + 1) + size_t(w)]; };
    int32_t forced = 0;
    for (int32_t i = 0; i < m; ++i) {
        const SchedExpert &xe = s.routed[size_t(misses[size_t(i)])];
        const bool gpu_only = xe.site == ExecSite::GPU;
        forced += gpu_only;
        x[size_t(i)] = gpu_only ? p.fixed_binary(1) : p.binary();
        for (int32_t w = 0; w <= n_waves; ++w) uw(i, w) = stream ? p.binary() : x[size_t(i)];
    }
    if (stream) {
        for (int32_t i = 0; i < m; ++i) {
            Row sum;
            for (int32_t w = 0; w <= n_waves; ++w) sum.add(uw(i, w), 1);
            p.equal(sum.add(x[size_t(i)], -1), 0);
            // Position among the GPU experts: p_i = sum of x_j, j < i. Wave w holds positions [lo, hi].
            for (int32_t w = 0; w <= n_waves; ++w) {
                const double lo = w == 0 ? 0 : double(free + (w - 1) * per_wave);
                const double hi = w == 0 ? double(free - 1) : double(free + w * per_wave - 1);
                Row up, down;
                for (int32_t j = 0; j < i; ++j) {
                    up.add(x[size_t(j)], 1);
                    down.add(x[size_t(j)], 1);
                }
                p.at_most(up.add(uw(i, w), big_n), hi + big_n);
                p.at_least(down.add(uw(i, w), -big_n), lo - big_n);
            }
        }
    } else if (m > 0) {
        Row sum;
        for (int32_t i = 0; i < m; ++i) sum.add(x[size_t(i)], 1);
        p.at_most(sum, double(std::max(free, forced)));
    }

    // Indicators: a = any FETCH (wave 0), b = any CPU expert, st = any STREAM, split = a and b and not st.
    const int a = p.binary(), b = cpu_only > 0 ? p.fixed_binary(1) : p.binary();
    const int st = p.binary(), split = p.binary();
    {
        Row r;  // a >= u_i0 for each i, a <= sum_i u_i0
        r.add(a, 1);
        for (int32_t i = 0; i < m; ++i) {
            p.at_least(Row().add(a, 1).add(uw(i, 0), -1), 0);
            r.add(uw(i, 0), -1);
        }
        p.at_most(r, 0);
    }
    if (cpu_only == 0) {
        Row r;
        r.add(b, 1);
        for (int32_t i = 0; i < m; ++i) {
            p.at_least(Row().add(b, 1).add(x[size_t(i)], 1), 1);  // b >= 1 - x_i
            r.add(x[size_t(i)], 1);
        }
        p.at_most(r, double(m));  // b <= m - sum x
    }
    {
        Row r;
        r.add(st, 1);
        for (int32_t i = 0; i < m; ++i) {
            for (int32_t w = 1; w <= n_waves; ++w) {
                p.at_least(Row().add(st, 1).add(uw(i, w), -1), 0);
                r.add(uw(i, w), -1);
            }
        }
        p.at_most(r, 0);
    }
    std::vector<int> v_wave(size_t(n_waves + 1), -1);  // v_w: wave w holds an expert (w >= 1), made below
    for (int32_t w = 1; w <= n_waves; ++w) v_wave[size_t(w)] = p.binary();
    // Residency of the loads: q_i = 1 (credit install_us) when the GPU expert i is among the layer's last
    // wave_slots loads in id order: q_i <= x_i and sum_{j > i} x_j <= wave_slots - 1 unless q_i = 0 (binary:
    // a fractional q would leak credit through the big-M row).
    for (int32_t i = 0; i < m; ++i) {
        const double install = s.routed[size_t(misses[size_t(i)])].install_us;
        if (install <= 0) continue;
        const int q = p.binary(-install);
        p.at_most(Row().add(q, 1).add(x[size_t(i)], -1), 0);
        Row later;
        for (int32_t j = i + 1; j < m; ++j) later.add(x[size_t(j)], 1);
        p.at_most(later.add(q, big_n), double(std::max(s.wave_slots, 1) - 1) + big_n);
    }
    p.at_most(Row().add(split, 1).add(a, -1), 0);
    p.at_most(Row().add(split, 1).add(b, -1), 0);
    p.at_most(Row().add(split, 1).add(st, 1), 1);
    p.at_least(Row().add(split, 1).add(a, -1).add(b, -1).add(st, 1), -1);

    // Host and CPU chain.
    const int c_start = p.time(), c_end = p.time();
    const double host = s.host_us, slack = s.issue_slack_us;
    p.at_least(Row().add(c_start, 1), host + (any_hit ? std::max(hit_arrival - slack, 0.0) : 0.0));
    {
        Row r;
        r.add(c_start, 1).add(a, -big).add(split, big);
        for (int32_t i = 0; i < m; ++i) r.add(uw(i, 0), -s.routed[size_t(misses[size_t(i)])].fetch_us);
        p.at_least(r, host + s.link_free_us - slack - big);
    }
    {
        Row r;
        r.add(c_end, 1).add(c_start, -1).add(b, -s.cpu_layer_us);
        double rhs = cpu_fixed;
        for (int32_t i = 0; i < m; ++i) {
            const double c = s.routed[size_t(misses[size_t(i)])].cpu_us;
            r.add(x[size_t(i)], c);
            rhs += c;
        }
        p.equal(r, rhs);
    }

    // Wave 0 (hits, and the FETCH experts unless split).
    const double w_us = s.wave_us;
    const int e0 = p.time();
    {
        Row r;  // (1) after the hits
        r.add(e0, 1);
        if (any_hit) r.add(split, -w_us);
        else r.add(a, -w_us);
        for (int32_t i = 0; i < m; ++i) r.add(uw(i, 0), -s.routed[size_t(misses[size_t(i)])].gpu_us);
        p.at_least(r, hit_arrival + hit_gpu + (any_hit ? w_us : 0.0));
    }
    {
        Row r;  // (2) after the FETCH copies
        r.add(e0, 1).add(split, hit_gpu).add(a, -big);
        for (int32_t i = 0; i < m; ++i) {
            const SchedExpert &xe = s.routed[size_t(misses[size_t(i)])];
            r.add(uw(i, 0), -(xe.fetch_us + xe.gpu_us));
        }
        p.at_least(r, s.link_free_us + w_us + hit_gpu - big);
    }
    {
        Row r;  // (3) split: after the CPU experts
        r.add(e0, 1).add(c_end, -1).add(split, -big);
        for (int32_t i = 0; i < m; ++i) r.add(uw(i, 0), -s.routed[size_t(misses[size_t(i)])].gpu_us);
        p.at_least(r, w_us - big);
    }

    // Streamed waves.
    int e_prev = e0, l_prev = -1;  // l_prev = -1: the link end after wave 0 is an expression
    for (int32_t w = 1; w <= n_waves; ++w) {
        const int v = v_wave[size_t(w)], sw = p.time(), lw = p.time(), ew = p.time();
        Row vmax;
        vmax.add(v, 1);
        for (int32_t i = 0; i < m; ++i) {
            p.at_least(Row().add(v, 1).add(uw(i, w), -1), 0);
            vmax.add(uw(i, w), -1);
        }
        p.at_most(vmax, 0);
        if (l_prev < 0) {
            Row r;
            r.add(sw, 1);
            for (int32_t i = 0; i < m; ++i) r.add(uw(i, 0), -s.routed[size_t(misses[size_t(i)])].fetch_us);
            p.at_least(r, s.link_free_us);
        } else {
            p.at_least(Row().add(sw, 1).add(l_prev, -1), 0);
        }
        p.at_least(Row().add(sw, 1).add(e_prev, -1).add(v, -big), -big);
        Row lr, er, cr;
        lr.add(lw, 1).add(sw, -1);
        er.add(ew, 1).add(lw, -1).add(v, -w_us - big);
        cr.add(ew, 1).add(c_end, -1).add(v, -w_us - big);
        for (int32_t i = 0; i < m; ++i) {
            const SchedExpert &xe = s.routed[size_t(misses[size_t(i)])];
            lr.add(uw(i, w), -xe.fetch_us);
            er.add(uw(i, w), -xe.gpu_us);
            cr.add(uw(i, w), -xe.gpu_us);
        }
        p.at_least(lr, 0);
        p.at_least(er, -big);
        p.at_least(cr, -big);
        p.at_least(Row().add(ew, 1).add(e_prev, -1), 0);
        e_prev = ew;
        l_prev = lw;
    }
    const int t = p.time(1.0);
    p.at_least(Row().add(t, 1).add(e_prev, -1), 0);
    p.at_least(Row().add(t, 1).add(c_end, -1), 0);

    // Prefetches issued in priority order: y_j = 1 issues it (credit install_us less its link price, link_price x
    // fetch_us), z_j = 1 when it also lands before its deadline (credit prob x miss_us).
    std::vector<int32_t> order;
    candidate_priority_order(s, order);
    while (!order.empty()) {
        const SchedCandidate &c = s.candidates[size_t(order.back())];
        if (c.prob * c.miss_us + c.install_us > 0) break;
        order.pop_back();  // worthless candidates are never planned
    }
    // Installs: a CPU-run miss copied behind everything (w_i <= 1 - x_i), not in a layer that streams, into the
    // slots the FETCH experts leave (sum w + sum u0 <= free_slots); credit install_us less its link price.
    std::vector<int> w_install(size_t(m), -1);
    {
        Row slots;
        for (int32_t i = 0; i < m; ++i) {
            const SchedExpert &xe = s.routed[size_t(misses[size_t(i)])];
            slots.add(uw(i, 0), 1);
            if (xe.site == ExecSite::GPU || xe.install_us <= 0) continue;
            w_install[size_t(i)] = p.binary(s.link_price * xe.fetch_us - xe.install_us);
            p.at_most(Row().add(w_install[size_t(i)], 1).add(x[size_t(i)], 1), 1);
            p.at_most(Row().add(w_install[size_t(i)], 1).add(st, 1), 1);
            slots.add(w_install[size_t(i)], 1);
        }
        if (std::any_of(w_install.begin(), w_install.end(), [](int c) { return c >= 0; })) {
            p.at_most(slots, double(std::max(free, forced)));
        }
    }
    std::vector<int> y(order.size());
    double stall_all = 0;
    for (const SchedCandidate &c : s.candidates) stall_all += c.prob * c.miss_us;
    const int32_t room = std::min(s.prefetch_room, o.max_prefetch_in_flight);
    {
        Row total;
        std::vector<Row> per(s.next_free.size());
        Row arrive;  // link end after the demand copies, plus the prefetches so far
        if (l_prev < 0) {
            for (int32_t i = 0; i < m; ++i) arrive.add(uw(i, 0), s.routed[size_t(misses[size_t(i)])].fetch_us);
        } else {
            arrive.add(l_prev, 1);
        }
        const double arrive_const = l_prev < 0 ? s.link_free_us : 0.0;
        for (size_t k = 0; k < order.size(); ++k) {
            const SchedCandidate &c = s.candidates[size_t(order[k])];
            y[k] = p.binary(s.link_price * c.fetch_us - c.install_us);
            const int z = p.binary(-c.prob * c.miss_us);
            p.at_most(Row().add(z, 1).add(y[k], -1), 0);
            total.add(y[k], 1);
            if (c.distance >= 1 && size_t(c.distance) <= per.size()) per[size_t(c.distance - 1)].add(y[k], 1);
            else glp_set_col_bnds(p.lp(), y[k], GLP_FX, 0, 0);
            arrive.add(y[k], c.fetch_us);
            Row r = arrive;
            r.add(z, big);
            p.at_most(r, prefetch_deadline_us(s, c.distance) - s.prefetch_backlog_us - arrive_const + big);
        }
        for (int c : w_install) {
            if (c >= 0) total.add(c, 1);
        }
        if (total.ind.size() > 1) p.at_most(total, double(std::max(room, 0)));
        for (size_t d = 0; d < per.size(); ++d) {
            if (per[d].ind.size() > 1) p.at_most(per[d], double(s.next_free[d]));
        }
    }

    res.n_binaries = p.binaries();
    res.n_rows = p.rows();
    glp_iocp parm;
    glp_init_iocp(&parm);
    parm.presolve = GLP_ON;
    parm.msg_lev = GLP_MSG_OFF;
    parm.tm_lim = o.time_limit_ms;
    parm.tol_int = 1e-9;  // x big (~1e4..1e6 us) stays far below a microsecond
    parm.tol_obj = 1e-9;
    const int ret = glp_intopt(p.lp(), &parm);
    const int status = glp_mip_status(p.lp());
    res.feasible = status == GLP_OPT || status == GLP_FEAS;
    res.optimal = status == GLP_OPT && ret == 0;
    res.timed_out = ret == GLP_ETMLIM;
    res.status = status == GLP_OPT   ? "optimal"
                 : status == GLP_FEAS ? (ret == GLP_ETMLIM ? "time limit (feasible)" : "feasible")
                 : status == GLP_NOFEAS ? "infeasible"
                                        : fmt::format("no solution (glp_intopt {})", ret);
    if (!res.feasible) return res;
    res.objective_us = glp_mip_obj_val(p.lp()) + stall_all;

    // The solution as a plan, re-evaluated with the timing model.
    std::vector<uint8_t> gpu(n, 0);
    for (int32_t i = 0; i < m; ++i) gpu[size_t(misses[size_t(i)])] = glp_mip_col_val(p.lp(), x[size_t(i)]) > 0.5;
    res.plan.reserve(int32_t(std::max<size_t>(n, 1)), int32_t(order.size()));
    decision_from_choice(s, gpu, res.plan.decision);
    res.plan.split = plan_splits(res.plan.decision);
    const PlanTimes demand = evaluate_plan(s, res.plan.decision, res.plan.split, {});
    double link = demand.link_end_us + s.prefetch_backlog_us;
    for (size_t k = 0; k < order.size(); ++k) {
        if (glp_mip_col_val(p.lp(), y[k]) < 0.5) continue;
        const SchedCandidate &c = s.candidates[size_t(order[k])];
        link += c.fetch_us;
        res.plan.prefetch.push_back(
            {c.layer, c.expert, c.prob, link, prefetch_deadline_us(s, c.distance), -1, order[k], -1});
    }
    for (int32_t i = 0; i < m; ++i) {
        if (w_install[size_t(i)] >= 0 && glp_mip_col_val(p.lp(), w_install[size_t(i)]) > 0.5) {
            res.plan.prefetch.push_back({s.layer, s.routed[size_t(misses[size_t(i)])].expert, 1.0, 0, 0, -1, -1,
                                         misses[size_t(i)]});
        }
    }
    res.plan.predicted = evaluate_plan(s, res.plan.decision, res.plan.split, res.plan.prefetch);
    res.plan.rule = "ilp";
    return res;
}

} // namespace prescope
