// Every chat template in ../shared/chat_templates, rendered over every case
// of tests/fixtures/chat_templates/cases.json, must equal byte for byte what
// Python jinja2 renders through transformers
// (tests/fixtures/make_chat_template_fixtures.py), and must fail where
// Python raised (with the template's own message for raise_exception).
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/civil_time.h"
#include "absl/time/time.h"
#include "engine/chat/chat_template.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using OJson = nlohmann::ordered_json;

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const fs::path kTemplates = fs::path(PDSERVE_SHARED_DIR) / "chat_templates";
const fs::path kFixtures = fs::path(PDSERVE_FIXTURES_DIR) / "chat_templates";

std::vector<std::string> TemplateNames() {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(kFixtures / "expected", ec)) {
    if (entry.path().extension() == ".json") names.push_back(entry.path().stem().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

class ChatTemplateFixtureTest : public testing::TestWithParam<std::string> {};

TEST_P(ChatTemplateFixtureTest, RendersLikeTransformers) {
  const std::string name = GetParam();
  const fs::path template_path = kTemplates / (name + ".jinja");
  if (!fs::exists(template_path)) GTEST_SKIP() << "no " << template_path;
  const OJson cases = OJson::parse(ReadAll(kFixtures / "cases.json"));
  const OJson expected = OJson::parse(ReadAll(kFixtures / "expected" / (name + ".json")));

  ChatTemplateTokens tokens;
  if (expected["bos_token"].is_string()) tokens.bos_token = expected["bos_token"].get<std::string>();
  if (expected["eos_token"].is_string()) tokens.eos_token = expected["eos_token"].get<std::string>();
  auto tmpl = ChatTemplate::Parse(ReadAll(template_path), tokens);
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();

  // The fixtures were made with strftime_now reading this local time.
  const absl::Time now = absl::FromCivil(absl::CivilSecond(2025, 3, 7, 14, 5, 9), absl::LocalTimeZone());
  ASSERT_EQ(cases["now"], "2025-03-07T14:05:09");

  int matched = 0, failed_as_expected = 0;
  for (const OJson& c : cases["cases"]) {
    const std::string case_name = c["name"];
    SCOPED_TRACE(name + " / " + case_name);
    ChatTemplate::RenderRequest request;
    request.messages = c["messages"];
    request.tools = c["tools"];
    request.documents = c["documents"];
    request.add_generation_prompt = c["add_generation_prompt"];
    request.kwargs = c["kwargs"];
    request.now = now;
    const OJson& want = expected["results"][case_name];
    auto got = (*tmpl)->Render(request);
    if (want.contains("output")) {
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, want["output"].get<std::string>());
      if (got.ok() && *got == want["output"].get<std::string>()) ++matched;
    } else {
      EXPECT_FALSE(got.ok()) << "Python raised " << want["error_type"] << ": " << want["error"]
                             << "\nbut C++ rendered:\n" << *got;
      if (!got.ok() && want["error_type"] == "TemplateError") {
        // raise_exception(msg): the message is the template's, verbatim.
        EXPECT_EQ(got.status().message(), want["error"].get<std::string>());
      }
      if (!got.ok()) ++failed_as_expected;
    }
  }
  RecordProperty("matched", matched);
  RecordProperty("failed_as_expected", failed_as_expected);
  std::printf("%s: %d byte-identical, %d raised as in Python, of %zu cases\n", name.c_str(), matched,
              failed_as_expected, cases["cases"].size());
}

INSTANTIATE_TEST_SUITE_P(AllTemplates, ChatTemplateFixtureTest, testing::ValuesIn(TemplateNames()),
                         [](const testing::TestParamInfo<std::string>& info) {
                           std::string n = info.param;
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

TEST(ChatTemplateFixtureTest, EveryTemplateHasFixtures) {
  if (!fs::exists(kTemplates)) GTEST_SKIP() << "no " << kTemplates;
  size_t templates = 0;
  for (const auto& entry : fs::directory_iterator(kTemplates)) {
    if (entry.path().extension() != ".jinja") continue;
    ++templates;
    EXPECT_TRUE(fs::exists(kFixtures / "expected" / (entry.path().stem().string() + ".json")))
        << entry.path() << " has no fixture: run tests/fixtures/make_chat_template_fixtures.py";
  }
  EXPECT_EQ(templates, TemplateNames().size());
}

}  // namespace
}  // namespace pdserve
