#include "planner/least_squares.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace pdserve::planner {
namespace {

using Matrix = std::vector<std::vector<double>>;

// min |A z - b|^2 over the columns marked in `in`, the others' z 0: the
// normal equations of the columns scaled to unit length (the step model's
// columns differ by ten orders of magnitude), by Gaussian elimination with
// partial pivoting; a column that is zero or a combination of earlier ones
// gets 0.
std::vector<double> UnconstrainedOn(const Matrix& a, const std::vector<double>& b,
                                    const std::vector<bool>& in) {
  std::vector<size_t> cols;
  std::vector<double> norm;
  for (size_t j = 0; j < in.size(); ++j) {
    if (!in[j]) continue;
    double sum = 0;
    for (const std::vector<double>& row : a) sum += row[j] * row[j];
    if (sum == 0) continue;  // A zero column: 0.
    cols.push_back(j);
    norm.push_back(std::sqrt(sum));
  }
  const size_t n = cols.size();
  Matrix m(n, std::vector<double>(n + 1, 0.0));
  for (size_t r = 0; r < a.size(); ++r) {
    for (size_t i = 0; i < n; ++i) {
      const double ai = a[r][cols[i]] / norm[i];
      for (size_t j = 0; j < n; ++j) m[i][j] += ai * a[r][cols[j]] / norm[j];
      m[i][n] += ai * b[r];
    }
  }
  std::vector<bool> dropped(n, false);
  for (size_t c = 0; c < n; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < n; ++r) {
      if (std::abs(m[r][c]) > std::abs(m[pivot][c])) pivot = r;
    }
    std::swap(m[c], m[pivot]);
    // Unit columns: a pivot this small is a column the others make.
    if (std::abs(m[c][c]) <= 1e-12) {
      dropped[c] = true;
      continue;
    }
    for (size_t r = 0; r < n; ++r) {
      if (r == c) continue;
      const double f = m[r][c] / m[c][c];
      for (size_t k = c; k <= n; ++k) m[r][k] -= f * m[c][k];
    }
  }
  std::vector<double> z(in.size(), 0.0);
  for (size_t i = 0; i < n; ++i) {
    if (!dropped[i]) z[cols[i]] = m[i][n] / m[i][i] / norm[i];
  }
  return z;
}

// A^T (b - A x): the steepest descent direction of |A x - b|^2 / 2.
std::vector<double> Gradient(const Matrix& a, const std::vector<double>& b,
                             const std::vector<double>& x) {
  std::vector<double> w(x.size(), 0.0);
  for (size_t r = 0; r < a.size(); ++r) {
    double residual = b[r];
    for (size_t j = 0; j < x.size(); ++j) residual -= a[r][j] * x[j];
    for (size_t j = 0; j < x.size(); ++j) w[j] += a[r][j] * residual;
  }
  return w;
}

}  // namespace

std::vector<double> NonNegativeLeastSquares(const Matrix& a, const std::vector<double>& b) {
  const size_t n = a.empty() ? 0 : a[0].size();
  std::vector<double> x(n, 0.0);
  std::vector<bool> in(n, false);  // The passive set: columns free to move.
  // A column enters while the gradient favours it by more than rounding.
  double scale = 0;
  for (double w : Gradient(a, b, x)) scale = std::max(scale, std::abs(w));
  const double tolerance = 1e-12 * scale;
  // A column that the gradient favours but whose subproblem gives it no
  // positive value (rounding; a combination of the set's columns) sits out
  // until the solution moves.
  std::vector<bool> stuck(n, false);
  // Each entry strictly lowers the objective, so no set repeats; the cap
  // only guards against rounding.
  for (size_t round = 0; round < 3 * n + 3; ++round) {
    const std::vector<double> w = Gradient(a, b, x);
    size_t enter = n;
    for (size_t j = 0; j < n; ++j) {
      if (!in[j] && !stuck[j] && w[j] > tolerance && (enter == n || w[j] > w[enter])) {
        enter = j;
      }
    }
    if (enter == n) break;  // Optimal: no column out of the set would help.
    in[enter] = true;
    for (size_t inner = 0; inner <= n; ++inner) {
      const std::vector<double> z = UnconstrainedOn(a, b, in);
      if (inner == 0 && z[enter] <= 0) {
        in[enter] = false;
        stuck[enter] = true;
        break;
      }
      // Move from x towards z as far as every column in the set stays
      // non-negative; the first to reach 0 (and any at 0) leave.
      double step = 1;
      size_t blocking = n;
      for (size_t j = 0; j < n; ++j) {
        if (in[j] && z[j] <= 0) {
          const double s = x[j] <= 0 ? 0 : x[j] / (x[j] - z[j]);
          if (blocking == n || s < step) {
            step = s;
            blocking = j;
          }
        }
      }
      if (blocking == n) {
        x = z;
        std::fill(stuck.begin(), stuck.end(), false);
        break;
      }
      for (size_t j = 0; j < n; ++j) {
        if (in[j]) x[j] += step * (z[j] - x[j]);
      }
      x[blocking] = 0;
      for (size_t j = 0; j < n; ++j) {
        if (in[j] && x[j] <= 0) {
          in[j] = false;
          x[j] = 0;
        }
      }
    }
  }
  return x;
}

}  // namespace pdserve::planner
