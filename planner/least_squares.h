// Non-negative least squares: min |A x - b|^2 subject to x >= 0, for the
// profiler's fits (profiler.cc: the step model, the transfer line, the
// decode step overheads). A few dozen columns, a few hundred rows.
#ifndef PDSERVE_PLANNER_LEAST_SQUARES_H_
#define PDSERVE_PLANNER_LEAST_SQUARES_H_

#include <vector>

namespace pdserve::planner {

// `a` holds the rows of A, all of one length n (the columns); b has a
// row's count of values. Returns x (n values, none negative) at the
// optimum, by Lawson and Hanson's active-set method ("Solving Least
// Squares Problems", 1974, chapter 23): the columns enter the solution
// one at a time by the gradient, each subproblem is solved unconstrained
// on the columns in it, and a column whose value would go negative leaves.
// Columns that are zero or a combination of others get 0 where the
// solution does not need them.
std::vector<double> NonNegativeLeastSquares(const std::vector<std::vector<double>>& a,
                                            const std::vector<double>& b);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_LEAST_SQUARES_H_
